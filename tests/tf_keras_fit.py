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
    mirrored    MirroredStrategy on 2 logical CPUs (not with other modes)
    worker      one MultiWorkerMirroredStrategy worker; TF_CONFIG set by the
                caller (tests/multi_worker_fit.py); writes into LOGDIR itself

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

import json
import os
import sys

os.environ["TF_USE_LEGACY_KERAS"] = "1"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

MODES = sys.argv[1].split(",") if len(sys.argv) > 1 else ["single"]
if "mirrored" in MODES:  # logical devices must exist before TensorFlow starts
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration(), tf.config.LogicalDeviceConfiguration()]
    )

import numpy as np  # noqa: E402
import tf_keras  # noqa: E402

import mpprof  # noqa: E402
from mpprof import reader  # noqa: E402
from mpprof.collectors import tf_keras_loss_scale  # noqa: E402

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


def build_model(mode: str, initial_scale: float) -> tf_keras.Model:
    mixed = mode != "float32"
    tf_keras.mixed_precision.set_global_policy("mixed_float16" if mixed else "float32")
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


def strategy_for(mode: str):
    if mode == "mirrored":
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
    probe = OptimizerProbe()
    profiler = mpprof.MixedPrecisionProfiler(logdir, numerics_every=3, gpu_interval=None)
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
        "dense_units": 8,
        "global_batch": GLOBAL_BATCH,
        "patched_after_fit": sorted(
            {"apply_gradients", "get_scaled_loss", "minimize"} & set(vars(optimizer))
            | ({"update"} & set(vars(optimizer._loss_scale)) if scaled else set())
        ),
    }
    if mode != "worker":
        found.update(describe_run(logdir, "train"))
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
        "context": run.context,
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
