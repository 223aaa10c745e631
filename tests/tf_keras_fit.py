"""Profiled tf-keras (Keras 2) fits, run as scripts; each prints one JSON line.

tf-keras must be chosen before TensorFlow is imported, so every fit runs in its
own process:

    python tests/tf_keras_fit.py MODE[,MODE...] LOGDIR

Each mode's fit writes into LOGDIR/MODE; the JSON line maps mode to findings.

    single      one device
    floor       one device; the gradients overflow even at scale 1
    floor_host  as floor, with the collector's host-polling fallback
    spe4        single, with steps_per_execution=4
    jit         single, with jit_compile=True
    float32     single in float32 with a plain SGD: no loss scale
    nan_loss    single, with a NaN target in step 5 of each epoch
    functional  a functional model with a nested Sequential and a subclassed
                layer that needs AutoGraph, and the legacy (OptimizerV2) SGD
    mirrored    MirroredStrategy on 2 logical CPUs (only with mirrored_split)
    mirrored_split  as mirrored; only the second replica's gradients overflow
                (the first replica sees zero inputs and targets)
    worker      one MultiWorkerMirroredStrategy worker; TF_CONFIG set by the
                caller (tests/multi_worker_fit.py); writes into LOGDIR itself.
                With MPPROF_TEST_FAKE_GPU=1 the worker's host has one fake
                NVML GPU (tests/fake_nvml.py) whose UUID ends in its task index.

The model is a deterministic gradient-overflow storm: ones as inputs, targets
of 1000 and an initial loss scale of 2**30, so the first steps overflow and the
scale halves until it fits; `dynamic_growth_steps=4` then makes it grow and
overflow again. A probe callback records the optimizer's own state after
every batch: the ground truth the records are compared with. In "floor" mode
the targets are so large that the gradients overflow float16 even unscaled:
the scale falls to tf-keras's floor of 1 and every step is skipped there.

Only the last example of each global batch of 16 is 1.0 (the others 0.5): under
a strategy it lands on the last replica (worker), never on the first, so the
first replica's own statistics cannot produce the recorded maximum.
"""

import contextlib
import json
import os
import sys

os.environ["TF_USE_LEGACY_KERAS"] = "1"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf

MODES = sys.argv[1].split(",") if len(sys.argv) > 1 else ["single"]
# Logical devices must exist before TensorFlow starts.
if any(mode.startswith("mirrored") for mode in MODES):
    from logical_cpus import split_cpu_in_two

    split_cpu_in_two()

import numpy as np  # noqa: E402
import tf_keras  # noqa: E402

import mpprof  # noqa: E402
from mpprof.backends.tf_keras import loss_scale_series as tf_keras_loss_scale  # noqa: E402
from mpprof.records import reader  # noqa: E402

EPOCHS = 2
GLOBAL_BATCH = 16
SAMPLES = 256


class OptimizerProbe(tf_keras.callbacks.Callback):
    """The optimizer's scale, counter and iterations after every batch."""

    def __init__(self):
        super().__init__()
        self.scales, self.counters, self.iterations = [], [], []

    def on_train_batch_end(self, batch, logs=None):
        optimizer = self.model.optimizer
        if not hasattr(optimizer, "loss_scale"):
            return
        self.scales.append(float(optimizer.loss_scale.numpy()))
        self.counters.append(int(optimizer.dynamic_counter.numpy()))
        self.iterations.append(int(optimizer.iterations.numpy()))

    def skipped_steps(self, initial_scale: float) -> list[int]:
        """Steps the optimizer skipped: its counter reset to 0 without the scale
        growing (the scale alone would miss skips at tf-keras's floor of 1)."""
        scales_before = [initial_scale] + self.scales[:-1] if self.scales else []
        return [
            step for step, (before, after, counter)
            in enumerate(zip(scales_before, self.scales, self.counters, strict=True))
            if counter == 0 and after <= before
        ]


class SignGate(tf_keras.layers.Layer):
    """Python control flow on a tensor: tf-keras runs its `call` through AutoGraph."""

    def call(self, x):
        if tf.reduce_sum(x) < 0:
            return -x
        return x


def build_model(mode: str, initial_scale: float) -> tf_keras.Model:
    mixed = mode != "float32"
    tf_keras.mixed_precision.set_global_policy("mixed_float16" if mixed else "float32")
    if mode == "functional":
        inputs = tf_keras.Input((8,))
        hidden = tf_keras.layers.Dense(8, name="dense")(inputs)
        hidden = SignGate(name="gate")(hidden)
        block = tf_keras.Sequential([tf_keras.layers.Dense(8, name="inner")], name="block")
        outputs = tf_keras.layers.Dense(1, dtype="float32", name="dense_1")(block(hidden))
        model = tf_keras.Model(inputs, outputs)
        optimizer = tf_keras.optimizers.legacy.SGD(1e-6)
    else:
        model = tf_keras.Sequential([
            tf_keras.layers.Input((8,)),
            tf_keras.layers.Dense(8, name="dense"),
            tf_keras.layers.Dense(1, dtype="float32", name="dense_1"),
        ])
        optimizer = tf_keras.optimizers.SGD(1e-6)
    if mixed:
        optimizer = tf_keras.mixed_precision.LossScaleOptimizer(
            optimizer, initial_scale=initial_scale, dynamic_growth_steps=4
        )
    model.compile(optimizer=optimizer, loss="mse",
                  steps_per_execution=4 if mode == "spe4" else 1,
                  jit_compile=mode == "jit")
    return model


def fake_host_gpu():
    """One fake NVML GPU for this worker's host, named after its task index."""
    from fake_nvml import FakeGpu, FakeNvmlLibrary, installed

    index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    return installed(FakeNvmlLibrary([FakeGpu(uuid=f"GPU-fake-worker-{index}")]))


def strategy_for(mode: str):
    if mode.startswith("mirrored"):
        return tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    if mode == "worker":
        return tf.distribute.MultiWorkerMirroredStrategy()
    return tf.distribute.get_strategy()


def fit(mode: str, logdir: str) -> dict:
    tf_keras.utils.set_random_seed(1)
    strategy = strategy_for(mode)
    floor = mode.startswith("floor")
    initial_scale = 4.0 if floor else 2.0**30
    with strategy.scope():
        model = build_model(mode, initial_scale)
    x = np.full((SAMPLES, 8), 0.5, np.float32)
    x[GLOBAL_BATCH - 1 :: GLOBAL_BATCH] = 1.0
    target = 1e7 if floor else 1000.0
    y = np.full((SAMPLES, 1), target, np.float32)
    if mode == "nan_loss":
        y[5 * GLOBAL_BATCH] = np.nan
    if mode == "mirrored_split":  # the first half of each global batch: replica 0
        first_replica = (np.arange(SAMPLES) % GLOBAL_BATCH) < GLOBAL_BATCH // 2
        x[first_replica], y[first_replica] = 0.0, 0.0
    probe = OptimizerProbe()
    fake_gpu = os.environ.get("MPPROF_TEST_FAKE_GPU") == "1"
    profiler = mpprof.MixedPrecisionProfiler(
        logdir, numerics_every=3, gpu_interval=0.1 if fake_gpu else None)
    with fake_host_gpu() if fake_gpu else contextlib.nullcontext():
        model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=EPOCHS, verbose=0, shuffle=False,
                  callbacks=[profiler, probe])
    first_dense = model.get_layer("dense")
    optimizer = model.optimizer
    scaled = hasattr(optimizer, "loss_scale")
    found = {
        "mode": mode,
        "pid": os.getpid(),
        "probe_scales": probe.scales,
        "probe_counters": probe.counters,
        "probe_iterations": probe.iterations,
        "probe_skipped": probe.skipped_steps(initial_scale),
        "iterations": int(optimizer.iterations.numpy()),
        "final_scale": float(optimizer.loss_scale.numpy()) if scaled else None,
        "expected_abs_max": _abs_max(first_dense(x)),
        "first_replica_abs_max": _abs_max(first_dense(x[x[:, 0] < 1.0])),
        "weights_finite": all(bool(np.isfinite(w).all()) for w in model.get_weights()),
        "dense_units": 8,
        "global_batch": GLOBAL_BATCH,
        "patched_after_fit": sorted(
            {"apply_gradients", "get_scaled_loss", "minimize"} & set(vars(optimizer))
            | ({"update"} & set(vars(optimizer._loss_scale)) if scaled else set())
        ),
    }
    if mode != "worker":
        found.update(describe_run(logdir, "train"))
        model.save(os.path.join(logdir, "model.keras"))  # works after fit
    return found


def main(modes: list[str], logdir: str) -> None:
    found = {}
    for mode in modes:
        # The host-polling fallback, as when tf-keras lacks the private method.
        tf_keras_loss_scale._UPDATE = "_no_such_method" if mode.endswith("_host") else "update"
        found[mode] = fit(mode, logdir if mode == "worker" else os.path.join(logdir, mode))
    print(json.dumps(found))


def _abs_max(tensor) -> float:
    return float(np.max(np.abs(np.asarray(tensor).astype(np.float32))))


def describe_run(logdir: str, name: str) -> dict:
    """What the reader finds in one run, as JSON-ready values."""
    run = reader.read_run(logdir, name)
    loss_scale = run.loss_scale
    numerics = run.numerics
    described = {
        "context": run.context.record,
        "health": run.health,
        "inventory": run.inventory,
        "warnings": run.warnings,
    }
    if loss_scale is not None:
        steps = np.arange(loss_scale.steps_run)
        described.update({
            "overflow_steps": loss_scale.overflow_steps.tolist(),
            "overflows": loss_scale.overflows.tolist(),
            "growths": loss_scale.growths.tolist(),
            "steps_run": loss_scale.steps_run,
            "scale_after": loss_scale.scale_after(steps).tolist(),
            "recorded_final_scale": loss_scale.final_scale,
        })
    if numerics is not None:
        described.update({
            "numerics_layers": numerics.layers,
            "numerics_variables": numerics.variables,
            "forward_count": numerics.forward["count"][:, 0].tolist(),
            "forward_abs_max": numerics.forward["abs_max"][:, 0].tolist(),
            "numerics_steps": numerics.steps.tolist(),
        })
    return described


if __name__ == "__main__":
    main(MODES, sys.argv[2])
