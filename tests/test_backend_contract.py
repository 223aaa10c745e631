"""The contract every registered backend passes (`mpprof.backends.protocol`).

Keras picks its backend once per process, so this suite runs once per
registered backend, each time on the backend Keras runs on: the main pytest
(TensorFlow, and tf-keras models where tf-keras is installed) and one pass
per other backend (`KERAS_BACKEND=jax`: `make test`). The first test checks
that `make test` runs it for every backend in `mpprof.backends.REGISTRY`.
mypy checks the protocol's signatures (`make test`); this suite checks what
each backend does with real training on CPU.
"""

import glob
import os
import re
import sys

import keras
import numpy as np
import pytest

import mpprof
from mpprof import backends
from mpprof.backends import base, protocol
from mpprof.backends.layer_call_patch import is_patched
from mpprof.backends.layer_records import walk_layers
from mpprof.backends.patching import Patches
from mpprof.recording.nvml.sampler import GpuSampler
from mpprof.records import reader, schema
from mpprof.records.run_context import RunContext

# The replay's seed overflow model, the device checks' too (benchmarks/).
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks"))
from bench_models import third_dense_model

BACKEND = keras.backend.backend()
REGISTERED = backends.registration(BACKEND)
MAKEFILE = os.path.join(os.path.dirname(os.path.dirname(__file__)), "Makefile")
STEPS = 6

# Every factory `Backend` declares, and the protocol of what it returns.
FACTORIES = {name: hint for name, hint in base.Backend.__annotations__.items()
             if "protocol." in str(hint)}


def model() -> keras.Model:
    """A small mixed_float16 model with a LossScaleOptimizer, compiled."""
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    found = keras.Sequential([
        keras.layers.Input((16,)),
        keras.layers.Dense(32, activation="relu", name="hidden"),
        keras.layers.Dense(4, dtype="float32", name="logits"),
    ])
    found.compile(optimizer=keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.01)),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return found


def data(samples: int = 8 * STEPS):
    rng = np.random.default_rng(0)
    return rng.random((samples, 16), dtype=np.float32), rng.integers(0, 4, samples)


def fit(log_dir, **profiler):
    x, y = data()
    model().fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False,
                callbacks=[mpprof.MixedPrecisionProfiler(
                    str(log_dir), gpu_interval=None, **profiler)])
    return reader.read_run(str(log_dir), schema.TRAIN_RUN)


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    """One profiled fit on this process's backend: sampled every 2 calls, an
    XProf window over steps 2-3."""
    return fit(tmp_path_factory.mktemp("contract"), numerics_every=2, profile_steps=(2, 3))


def test_make_test_runs_this_suite_on_every_registered_backend():
    with open(MAKEFILE) as f:
        recipe = f.read().split("\ntest:", 1)[1].split("\n\n", 1)[0]
    covered = set()
    for line in recipe.splitlines():
        if "pytest" not in line:
            continue
        named = re.search(r"KERAS_BACKEND=(\w+)", line)
        runs_contract = ("tests/test_backend_contract.py" in line
                         or not re.search(r"pytest\s.*\btests/", line))
        if runs_contract:
            # Without KERAS_BACKEND, Keras runs on TensorFlow.
            covered.add(named.group(1) if named else "tensorflow")
    assert covered == set(backends.REGISTRY)


def test_this_process_backend_is_registered_with_its_code():
    assert REGISTERED is not None and REGISTERED.name == BACKEND
    assert callable(backends.load(REGISTERED.backend))
    if REGISTERED.replay_engine is not None:
        engine = backends.load(REGISTERED.replay_engine)
        assert callable(engine.replay) and callable(engine.engine_for)
    if REGISTERED.op_names is not None:
        op_names = backends.load(REGISTERED.op_names)
        assert op_names.layer_of("MatMul") in (None, "")  # no scope: no layer to name


def test_backend_for_gives_every_factory_the_protocol_declares():
    found = backends.backend_for(model())
    assert isinstance(found, base.Backend)
    assert found.name == BACKEND and found.flavor
    assert found.apply_method and isinstance(found.loss_methods, tuple)
    assert FACTORIES, "Backend declares no factory"
    missing = [name for name in FACTORIES if not callable(getattr(found, name, None))]
    assert missing == []
    assert int(found.distribute_strategy(model()).num_replicas_in_sync) >= 1
    assert found.steps_per_execution(model()) == 1


def test_a_fit_runs_every_collector_the_backend_made(fitted):
    collectors = fitted.context["collectors"]
    for name in ("precision", "loss_scale", "loss_health", "numerics", "kernels"):
        assert collectors[name]["state"] == "ok", (name, collectors[name])
    # A backend with a replay engine captures the sampled steps that go
    # wrong (none in this healthy fit); one without says why it does not.
    capture = collectors["replay_capture"]
    if REGISTERED.replay_engine is not None:
        assert capture == {"state": "ok", "budget": 2, "captures": []}, capture
    else:
        assert capture["state"] == "unavailable" and REGISTERED.framework in capture["reason"]
    assert fitted.inventory["layers"]
    assert len(fitted.loss_scale.progress) > 0  # the scale, step by step
    # Sampled every 2 calls: steps 2 and 4 of 0-5 (the first call traces the plain step).
    assert list(fitted.numerics.steps) == [2, 4]
    assert {"hidden", "logits"} <= set(fitted.numerics.layers)


def test_the_run_context_is_framework_neutral(fitted):
    context = fitted.context
    assert context["framework"]["name"] == REGISTERED.framework
    assert isinstance(context["framework"]["version"], str)
    assert context["gpus_visible"] == 0  # this CPU
    assert context["hardware"]["gpus_visible"] == 0
    assert context["hardware"]["reason"].startswith(f"{REGISTERED.framework} sees no GPU")
    # No key names a backend: the framework is data.
    assert [key for key in context if BACKEND in key or "jax" in key] == []
    assert RunContext(context).versions.startswith(
        f"{REGISTERED.framework} {context['framework']['version']}, Keras ")


def test_hardware_facts_say_what_the_framework_sees():
    sampler = GpuSampler()
    sampler.probe()
    facts = backends.backend_for(model()).hardware_facts(sampler)
    assert {"cpu_only", "reason", "gpus", "driver_version", "cuda_driver_version", "source",
            "nvml", "gpus_visible"} <= set(facts)
    assert facts["cpu_only"] is True and facts["gpus_visible"] == 0


def test_the_layer_call_patch_wraps_every_layer_and_restores_them():
    built = model()
    found = backends.backend_for(built)

    class Seen:
        def __init__(self):
            self.layers = []

        def on_call(self, layer, args, kwargs, outputs):
            self.layers.append(layer.name)
            return outputs

    seen = Seen()
    patches = Patches()
    patch = found.LayerCallPatch(built, [])
    assert isinstance(patch, protocol.LayerCallPatch)
    patch.install(patches)
    patch.add_hook(seen)
    layers = [layer for _, layer, _ in walk_layers(built)]
    assert all(is_patched(layer) for layer in layers)
    built(data(4)[0])  # an eager call: every wrapper runs
    assert {"hidden", "logits"} <= set(seen.layers)
    assert patches.restore() == []
    assert not any(is_patched(layer) for layer in layers)


def test_with_no_counter_the_call_alarm_never_rings():
    built = model()
    alarm = backends.backend_for(built).CallAlarm(lambda: [], lambda: True)
    patches = Patches()
    alarm.install(built, patches, False)
    assert alarm.unchanged(None)
    assert alarm.hold(None, 0, 0, wait=True) == []
    assert alarm.drain() is None
    patches.restore()


def test_a_captured_overflow_replays_to_the_same_verified_fix(tmp_path):
    """A backend with a replay engine captures the sampled step that
    overflowed, and its engine names the same layer and verifies the same
    map as every other backend's; the op is the framework's own (MatMul,
    dot_general, or on a CPU PyTorch's cast of Keras' float32 product)."""
    if REGISTERED.replay_engine is None:
        pytest.skip(f"{REGISTERED.framework} has no replay engine registered")
    ones = np.ones((32, 8), "float32")
    third_dense_model().fit(ones, ones[:, :1], batch_size=8, epochs=1, verbose=0, shuffle=False,
                      callbacks=[mpprof.MixedPrecisionProfiler(
                          str(tmp_path), gpu_interval=None, numerics_every=2)])
    capture = reader.read_run(str(tmp_path), schema.TRAIN_RUN).context["collectors"][
        "replay_capture"]
    assert capture["state"] == "ok" and capture["captures"], capture
    result = mpprof.replay.replay(str(tmp_path), save=False)
    first = result["first_op"]
    assert (first["layer"], first["phase"], first["dtype"]) == ("d3", "forward", "float16")
    assert first["op"] and "inf" in first["output"]
    assert result["divergence"][0]["layer"] == "d3"
    assert result["float32_layers"] == ["d3"]
    assert result["policy_map"] == {"third_dense/d3": "float32"}
    assert result["verified"] is True, result["verified_detail"]
    assert result["backend"] == BACKEND


def sessions(run_dir) -> list[str]:
    return sorted(glob.glob(os.path.join(run_dir, "plugins", "profile", "*")))


def test_the_profile_window_records_no_gpu_kernels_on_cpu_not_zero(fitted):
    record = fitted.records[schema.KERNEL_STATS][-1]
    assert record.step == 4  # written right after step 3, the window's last
    assert record.value["no_gpu_kernels"] is True
    assert record.value["tensor_core_share"] is None
    assert "no GPU kernels" in record.value["reason"]
    entry = fitted.context["collectors"]["kernels"]
    assert entry == {"state": "ok", "window": [2, 3], "phase": "done",
                     "reason": "traced steps 2-3", "source": record.value["source"],
                     "traced_steps": [2, 3]}
    assert sessions(fitted.path) == [record.value["source"]]
    assert fitted.gpu.kernels == record.value


def test_a_running_profiler_makes_the_window_step_aside(tmp_path):
    """The framework's profiler, started by someone else, is left to them."""
    other = str(tmp_path / "someone_else")
    someone_else = backends.backend_for(model()).profile_window(0, 0, other)
    someone_else._start_profiler(other)
    try:
        run = fit(tmp_path / "run", profile_steps=(1, 2), numerics_every=None)
    finally:
        someone_else._stop_profiler()  # still theirs: mpprof did not stop it
    entry = run.context["collectors"]["kernels"]
    assert entry["state"] == "unavailable" and entry["phase"] == "refused"
    assert entry["reason"].startswith("another profiler was running at step 1")
    assert schema.KERNEL_STATS not in run.records
    assert len(sessions(other)) == 1  # their trace, whole
