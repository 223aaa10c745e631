"""The same Keras 3 runs on whichever backend Keras runs on, each summed up
as JSON (findings, the loss-scale events, the numerics the findings rest
on), for tests/test_backend_parity.py to compare across TensorFlow, JAX and
PyTorch.

    KERAS_BACKEND=jax python tests/parity_runs.py OUT_DIR [SCENARIO ...]

The recipes are tests/jax/jax_runs.py's (Keras 3 only): constant kernels or
fixed data where a value is compared, so that both backends compute the
same numbers (their random initializers differ).
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "jax"))

import jax_runs
import keras
import numpy as np
from float8_runs import compiled_float8_model, float8_data

import mpprof
from mpprof import diagnosis


def _tiny_mse(y_true, y_pred):
    return 1e-6 * keras.ops.mean(keras.ops.square(y_true - y_pred), axis=-1)


def _inf_in_batch_5():
    # An infinity, not a NaN: TensorFlow's CPU relu turns NaN into 0 (the
    # loss stays finite there), JAX's keeps it; both keep an infinity.
    x, y = jax_runs.classes()
    x[5 * 8 + 3, 0] = np.inf
    return x, y


# Scenarios whose first capture is replayed (`mpprof.replay.replay`, each
# backend's engine): the verdict, not the op's name, which is each
# framework's own (MatMul, dot_general, mm).
REPLAYED = ("forward_overflow",)


# Float8 scenarios start from random kernels, which the two backends draw
# differently: their findings and statuses are compared, not their values.
FLOAT8 = ("float8_saturating", "float8_underflowing", "float8_healthy")


def _scenarios():
    """name -> (model maker, (x, y), profiler keyword arguments)."""
    constant = keras.initializers.Constant
    return {
        "healthy": (lambda: jax_runs.classifier("mixed_float16"), jax_runs.classes(), {}),
        "collapse": (jax_runs.regression, jax_runs.ones(8 * 32, 1e8), {"numerics_every": None}),
        "storm": (lambda: jax_runs.regression(initial_scale=2.0**30),
                  jax_runs.ones(8 * 24, 1000.0), {"numerics_every": None}),
        "growth_probes": (lambda: jax_runs.regression(initial_scale=2.0**9, growth_steps=3),
                          jax_runs.ones(8 * 40, 1000.0), {"numerics_every": None}),
        "float16_head": (lambda: jax_runs.classifier("mixed_float16", last_dtype=None),
                         jax_runs.classes(), {}),
        "no_loss_scaling": (lambda: jax_runs.classifier("mixed_float16", auto_scale_loss=False),
                            jax_runs.classes(), {}),
        "nan_loss": (lambda: jax_runs.classifier(
            "float32", optimizer=keras.optimizers.SGD(0.1)), _inf_in_batch_5(), {}),
        "forward_overflow": (lambda: jax_runs.regression(constant(300.0)),
                             jax_runs.ones(8 * 4, 0.0), {"numerics_every": 1}),
        "float32_island": (lambda: jax_runs.regression(constant(8.0), head=constant(100.0)),
                           jax_runs.ones(8 * 4, 0.0), {"numerics_every": 1}),
        "gradient_underflow": (lambda: jax_runs.regression(
            constant(0.1), head=constant(0.5), initial_scale=1.0, loss=_tiny_mse,
            growth_steps=10_000), jax_runs.ones(8 * 4, 1.0), {"numerics_every": 1}),
        "gradient_scaled": (lambda: jax_runs.regression(
            constant(0.1), head=constant(0.5), loss=_tiny_mse),
            jax_runs.ones(8 * 4, 1.0), {"numerics_every": 1}),
        "float8_saturating": (compiled_float8_model, float8_data(4.0), {"numerics_every": 1}),
        "float8_underflowing": (lambda: compiled_float8_model(1e12), float8_data(),
                                {"numerics_every": 1}),
        "float8_healthy": (compiled_float8_model, float8_data(), {"numerics_every": 1}),
    }


def _summary(run, values: bool = True) -> dict:
    evaluation = diagnosis.evaluate(run)
    summary = {
        "findings": sorted({(f.code, f.layer, f.step) for f in evaluation.findings},
                           key=str),
        "statuses": {c.code: c.status for c in evaluation.checks},
        "health": {key: run.health.get(key) for key in
                   ("loss_watched", "first_nonfinite_loss_step", "nonfinite_loss_steps")},
    }
    if not values:
        return summary
    if run.loss_scale is not None:
        summary["overflows"] = run.loss_scale.overflows.tolist()
        summary["growths"] = run.loss_scale.growths.tolist()
    if run.numerics is not None:
        summary["numerics_layers"] = list(run.numerics.layers)
        summary["numerics_steps"] = np.asarray(run.numerics.steps).tolist()
        summary["forensic_steps"] = np.asarray(run.numerics.steps)[
            np.asarray(run.numerics.forensic, dtype=bool)].tolist()
        summary["forward_abs_max"] = run.numerics.forward["abs_max"].tolist()
        summary["forward_nonfinite"] = run.numerics.forward["nonfinite_frac"].tolist()
        summary["backward_subnormal"] = run.numerics.backward["subnormal_frac"].tolist()
    return summary


def _replay_summary(log_dir: str) -> dict:
    result = mpprof.replay.replay(log_dir, save=False)
    first = result["first_op"] or {}
    return {"first_op": [first.get("layer"), first.get("phase"), first.get("dtype")],
            **{key: result.get(key) for key in ("float32_layers", "policy_map", "verified",
                                                "float32_clean")}}


def main(out_dir: str) -> None:
    summaries = {}
    for name, (make, (x, y), profiler) in _scenarios().items():
        if len(sys.argv) > 2 and name not in sys.argv[2:]:
            continue
        log_dir = os.path.join(out_dir, name)
        run = jax_runs.fit(log_dir, make(), x, y, **profiler)
        summaries[name] = _summary(run, values=name not in FLOAT8)
        if name in REPLAYED:
            summaries[name]["replay"] = _replay_summary(log_dir)
    summaries["backend"] = keras.backend.backend()
    with open(os.path.join(out_dir, "summaries.json"), "w") as f:
        json.dump(summaries, f, default=str)


if __name__ == "__main__":
    main(sys.argv[1])
