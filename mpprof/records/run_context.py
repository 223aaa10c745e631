"""The RUN_CONTEXT record, typed: what a run was, declared once.

The callback writes the run context as one JSON object at train begin and
at each flush; the latest one holds. `RunContext` is how every reader (the
diagnosis, the CLI, the report, the tab) asks for its fields: a read-only
mapping of the record with one typed property per field. Runs written by an
older mpprof lack newer fields; each property says what it gives then.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping

# How the fit stands ("fit_state"): "running" from train begin (rewritten at
# every flush), "ended" when fit returned, "failed" when it raised (or when the
# profiler could not record it at all: its context says why). A run whose
# latest context still says "running" was cut short (killed, or still going).
FIT_RUNNING = "running"
FIT_ENDED = "ended"
FIT_FAILED = "failed"
FIT_STATES = (FIT_RUNNING, FIT_ENDED, FIT_FAILED)


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_KERAS_WRAPPER = "Exception encountered when calling"


def without_ansi(message) -> str:
    """A `fit_error` message without its terminal colour codes (Keras wraps
    the user's error in bold)."""
    return _ANSI.sub("", str(message or ""))


def error_headline(message) -> str:
    """A `fit_error` message's first line, ANSI codes dropped; for Keras'
    "Exception encountered when calling X.call()." wrapper, with the user's
    own first line after it."""
    lines = [line.strip() for line in without_ansi(message).splitlines()
             if line.strip()]
    if not lines:
        return ""
    if lines[0].startswith(_KERAS_WRAPPER) and len(lines) > 1:
        return f"{lines[0]} {lines[1]}"
    return lines[0]


class RunContext(Mapping):
    """A run's latest run context.

    Args:
        record: the RUN_CONTEXT record's value (None: the run has none).
    """

    def __init__(self, record: Mapping | None = None):
        self._record = record or {}

    def __getitem__(self, key: str):
        return self._record[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._record)

    def __len__(self) -> int:
        return len(self._record)

    def __repr__(self) -> str:
        return f"RunContext({self._record!r})"

    @property
    def record(self) -> dict:
        """The record itself, as written (for JSON)."""
        return self._record

    def collector(self, name: str) -> dict:
        """The state a collector reported (`{"state": "ok"|"failed"|
        "unavailable"|"off", "reason"?, its own settings}`); {} when none."""
        return (self._record.get("collectors") or {}).get(name) or {}

    @property
    def collectors(self) -> dict:
        """Every collector's state, by name."""
        return self._record.get("collectors") or {}

    @property
    def fit_state(self) -> str | None:
        """One of `FIT_STATES`; None for runs older than the field."""
        return self._record.get("fit_state")

    @property
    def fit_error(self) -> dict | None:
        """What `model.fit` raised, for a fit that failed inside a train step:
        {"type", "module", "message", "step" (the first step of the call that
        raised)}; None when it did not raise there (or for older runs)."""
        error = self._record.get("fit_error")
        return error if isinstance(error, dict) else None

    @property
    def keras_flavor(self) -> str | None:
        """"keras" (Keras 3) or "tf_keras" (Keras 2)."""
        return self._record.get("keras_flavor")

    @property
    def keras_backend(self) -> str | None:
        return self._record.get("keras_backend")

    @property
    def model_policy(self) -> str | None:
        return self._record.get("model_policy")

    @property
    def global_policy(self) -> str | None:
        return self._record.get("global_policy")

    @property
    def optimizer(self) -> str | None:
        """The class name of the primary optimizer (the compiled one before
        the step was traced)."""
        return self._record.get("optimizer")

    @property
    def optimizers(self) -> list[dict] | None:
        """Each optimizer the traced step used (`OptimizerUsage.describe`);
        None before the step was traced, or for runs older than the field."""
        return self._record.get("optimizers")

    @property
    def jit_compile(self) -> bool | None:
        return self._record.get("jit_compile")

    @property
    def steps_per_execution(self) -> int | None:
        return self._record.get("steps_per_execution")

    @property
    def strategy(self) -> str:
        """The distribution strategy and its replicas, e.g. "OneDeviceStrategy x1"."""
        return (f"{self._record.get('distribution_strategy')} "
                f"x{self._record.get('num_replicas')}")

    @property
    def devices(self) -> list[dict]:
        """The logical devices the framework saw (`{"name", "type"}`); in one
        process's own run of a job across processes, that process's own (JAX
        sees every process's devices; `local_devices` are its own)."""
        if self.run_role == "worker" and self._record.get("local_devices"):
            return self._record["local_devices"]
        return self._record.get("devices") or []

    @property
    def hardware(self) -> dict | None:
        """The GPUs' facts (NVML or the framework's), None when not known."""
        return self._record.get("hardware")

    @property
    def gpus_visible(self) -> int | None:
        """How many GPUs the framework saw; None when not recorded."""
        record = self._record
        if "gpus_visible" in record:
            return record["gpus_visible"]
        # Runs written before the keys were framework-neutral.
        return record.get("gpus_visible_to_tensorflow", record.get("gpus_visible_to_jax"))

    @property
    def float32_matmuls(self) -> dict | None:
        """What the framework runs a float32 matmul as: `{"framework",
        "tf32_enabled" (TensorFlow's TF32 switch, or JAX's default matmul
        precision other than "highest"), "setting" (in words), "disable" (the
        code that turns it off), "jax_default_matmul_precision" (JAX)}`;
        None in runs recorded before mpprof said."""
        return self._record.get("float32_matmuls")

    @property
    def framework(self) -> dict:
        """The framework the model trained on: `{"name", "version",
        "libraries"}` (its other libraries' versions); from the older
        per-framework keys for older runs."""
        record = self._record
        found = record.get("framework")
        if isinstance(found, dict):
            return {"name": found.get("name"), "version": found.get("version"),
                    "libraries": found.get("libraries") or {}}
        # Runs written before the keys were framework-neutral.
        if "jax_version" in record:
            return {"name": "JAX", "version": record["jax_version"],
                    "libraries": {"jaxlib": record.get("jaxlib_version")}}
        return {"name": "TensorFlow", "version": record.get("tensorflow_version"),
                "libraries": {}}

    @property
    def versions(self) -> str:
        """The framework, Keras, mpprof and Python versions, in words."""
        record, framework = self._record, self.framework
        return (f"{framework['name']} {framework['version']}, "
                f"Keras {record.get('keras_version')}, "
                f"mpprof {record.get('mpprof_version')}, Python {record.get('python_version')}")

    @property
    def host(self) -> str | None:
        return self._record.get("host")

    @property
    def distributed(self) -> dict:
        """This process's role under a multi-worker fit (`WorkerRole.describe`)."""
        return self._record.get("distributed") or {}

    @property
    def run_role(self) -> str | None:
        """"worker" for a worker's own run of a multi-worker fit, else None."""
        return self._record.get("run_role")

    @property
    def worker_evidence(self) -> dict:
        return self._record.get("worker_evidence") or {}
