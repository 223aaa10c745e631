"""A large synthetic mpprof run, written through `mpprof.records.writer.RecordWriter`.

For the dashboard and diagnosis benchmarks: no training, but every record the
callback writes, at the scale of a long run (default: 1M steps, 200 layers,
1,000 numerics samples, NVML samples every 0.5 s of a 5.5 h run), in the
chunks the callback writes them (loss-scale events and progress every 500
steps, GPU samples every 100 rounds). Deterministic for a given seed.

    .venv/bin/python benchmarks/synthetic_logdir.py LOGDIR [--steps N]
        [--layers L] [--samples S] [--seed K]
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import tiny  # benchmarks/, on the path when run as a script

from mpprof.records import schema
from mpprof.records.writer import RecordWriter

FLUSH_EVERY_STEPS = 500
GROWTH_STEPS = 2000
STEP_SECONDS = 0.02
GPU_SAMPLE_SECONDS = 0.5
GPU_ROWS_PER_RECORD = 100


def write_synthetic_run(
    run_dir: str | os.PathLike,
    *,
    steps: int = 1_000_000,
    layers: int = 200,
    samples: int = 1000,
    seed: int = 0,
) -> None:
    """Writes one mixed_float16 run of `steps` steps into `run_dir`."""
    rng = np.random.default_rng(seed)
    writer = RecordWriter(run_dir)
    names = [f"block_{i:03d}/dense" for i in range(layers)]
    writer.write_json(schema.RUN_CONTEXT, _context(), step=0)
    writer.write_json(schema.INVENTORY, _inventory(names), step=0)
    _write_loss_scale(writer, steps)
    _write_numerics(writer, rng, names, steps, samples)
    _write_gpu(writer, rng, steps)
    writer.close()


def _context() -> dict:
    return {
        "mpprof_version": "synthetic",
        "global_policy": "mixed_float16",
        "model_policy": "mixed_float16",
        "optimizer": "LossScaleOptimizer",
        "jit_compile": True,
        "run_eagerly": False,
        "steps_per_execution": 1,
        "distribution_strategy": "_DefaultDistributionStrategy",
        "num_replicas": 1,
        "devices": [{"name": "/device:GPU:0", "type": "GPU"}],
        "framework": {"name": "TensorFlow", "version": "synthetic", "libraries": {}},
        "gpus_visible": 1,
        "collectors": {
            "gpu": {
                "state": "ok",
                "mode": "gpm",
                "reason": "synthetic: GPM supported",
                "devices": [{"index": 0, "name": "Synthetic H100", "mode": "gpm"}],
            }
        },
        "start_step": 0,
        "fit_count": 1,
        "wall_time": 1.7e9,
    }


def _inventory(names: list[str]) -> dict:
    layers = []
    for i, name in enumerate(names):
        units = 1000 if i == len(names) - 1 else 512
        island = i % 50 == 49  # a LayerNormalization-like float32 layer now and then
        layers.append(
            {
                "name": name,
                "class": "Dense",
                "parent": None,
                "is_leaf": True,
                "call_index": i,
                "policy": "float32" if island else "mixed_float16",
                "compute_dtype": "float32" if island else "float16",
                "variable_dtype": "float32",
                "output_dtypes": ["float32" if island else "float16"],
                "params": 512 * units + units,
                "gemm_dims": [512, units],
                "misaligned_dims": [],
                "tensor_core_friendly": True,
                "float32_island": island,
            }
        )
    casts = [
        {
            "layer": names[i + 1],
            "from_layer": names[i],
            "from_dtype": "float32",
            "to_dtype": "float16",
        }
        for i in range(len(names) - 1)
        if layers[i]["float32_island"]
    ]
    return {
        "model": {
            "name": "synthetic",
            "class": "Sequential",
            "policy": "mixed_float16",
            "output_dtypes": ["float16"],
            "params": sum(x["params"] for x in layers),
        },
        "layers": layers,
        "casts": casts,
    }


def _loss_scale_events(steps: int) -> np.ndarray:
    """A storm of 15 overflows from 2**30, then growth + probe overflow cycles."""
    events, scale, step = [], 2.0**30, 0
    for _ in range(15):
        events.append((step, scale, scale / 2, schema.EVENT_OVERFLOW))
        scale /= 2
        step += 1
    while step + GROWTH_STEPS < steps:
        step += GROWTH_STEPS
        events.append((step - 1, scale, scale * 2, schema.EVENT_GROWTH))
        events.append((step, scale * 2, scale, schema.EVENT_OVERFLOW))
        step += 1
    return np.asarray(events, dtype=np.float64)


def _write_loss_scale(writer: RecordWriter, steps: int) -> None:
    events = _loss_scale_events(steps)
    skipped = np.cumsum(events[:, 3] == schema.EVENT_OVERFLOW)
    for end in range(FLUSH_EVERY_STEPS, steps + FLUSH_EVERY_STEPS, FLUSH_EVERY_STEPS):
        end = min(end, steps)
        chunk = (events[:, 0] >= end - FLUSH_EVERY_STEPS) & (events[:, 0] < end)
        if chunk.any():
            writer.write_array(schema.LOSS_SCALE_EVENTS, events[chunk], step=end)
        done = events[:, 0] < end
        scale = events[done][-1, 2] if done.any() else 2.0**30
        skipped_now = int(skipped[done][-1]) if done.any() else 0
        writer.write_array(
            schema.LOSS_SCALE_PROGRESS, [end, scale, skipped_now], step=end
        )


def _write_numerics(writer, rng, names, steps, samples) -> None:
    variables = [f"{name}/{w}" for name in names for w in ("kernel", "bias")]
    edges = schema.NUMERICS_HIST_EDGES
    writer.write_json(
        schema.NUMERICS_LAYOUT,
        {
            "layers": names,
            "variables": variables,
            "hist_edges": edges,
            "policy_max": schema.FLOAT16_MAX,
            "aggregation": "sum counts, max abs_max",
        },
        step=0,
    )
    count = 4096.0 * 512
    depth = np.linspace(0.0, 1.0, len(names))
    for i, step in enumerate(np.linspace(0, steps - 1, samples).astype(np.int64)):
        forensic = float(i % 100 == 0)
        writer.write_array(
            schema.NUMERICS_STEP,
            [step, 2.0 - i / samples, 2.0**15, forensic, 1],
            step=step,
        )
        for record, magnitude in (
            (schema.NUMERICS_FORWARD, 10 ** (1 + 3 * depth)),
            (schema.NUMERICS_BACKWARD, 10 ** (-2 - 3 * depth)),
        ):
            writer.write_array(record, _stats(rng, count, magnitude), step=step)
        for record in (schema.NUMERICS_FORWARD_HIST, schema.NUMERICS_BACKWARD_HIST):
            histogram = rng.multinomial(
                int(count),
                np.full(len(edges) + 1, 1 / (len(edges) + 1)),
                size=len(names),
            )
            writer.write_array(record, histogram, step=step)
        for record in (schema.NUMERICS_GRADIENTS, schema.NUMERICS_UNSCALED_GRADIENTS):
            writer.write_array(
                record, _stats(rng, count, np.full(len(variables), 1e-3)), step=step
            )


def _stats(rng, count: float, magnitude: np.ndarray) -> np.ndarray:
    """Rows of NUMERICS_STAT_COLUMNS around `magnitude` (one row per entry)."""
    rows = len(magnitude)
    zero = rng.uniform(0.0, 0.05, rows) * count
    below_normal = rng.uniform(0.0, 0.2, rows) * count * (magnitude < 1e-3)
    below_subnormal = below_normal * rng.uniform(0.0, 0.5, rows)
    abs_max = magnitude * rng.uniform(0.5, 2.0, rows)
    nonfinite = np.zeros(rows)
    return np.column_stack(
        [np.full(rows, count), nonfinite, zero, below_normal, below_subnormal, abs_max]
    )


def _write_gpu(writer: RecordWriter, rng, steps: int) -> None:
    columns = schema.GPU_SAMPLE_COLUMNS
    rounds = int(steps * STEP_SECONDS / GPU_SAMPLE_SECONDS)
    for start in range(0, rounds, GPU_ROWS_PER_RECORD):
        n = min(GPU_ROWS_PER_RECORD, rounds - start)
        rows = np.full((n, len(columns)), np.nan)
        t = (start + np.arange(n)) * GPU_SAMPLE_SECONDS
        rows[:, columns.index("wall_time")] = 1.7e9 + t
        rows[:, columns.index("step")] = np.floor(t / STEP_SECONDS)
        rows[:, columns.index("device")] = 0
        for name, mean in (
            ("tensor_util", 45),
            ("sm_util", 80),
            ("gpu_util", 97),
            ("mem_util", 40),
            ("dram_bw_util", 55),
        ):
            rows[:, columns.index(name)] = np.clip(rng.normal(mean, 8, n), 0, 100)
        rows[:, columns.index("power_w")] = rng.normal(550, 30, n)
        writer.write_array(schema.GPU_SAMPLES, rows, step=int(rows[-1, 1]))
    writer.write_json(
        schema.KERNEL_STATS,
        {
            "source": "synthetic",
            "tensor_core_share": 0.62,
            "total_gpu_kernel_us": 1e6,
            "tensor_core_us": 6.2e5,
            "eligible_not_using_us": 1e5,
            "top_ops": [],
        },
        step=steps,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("logdir")
    parser.add_argument("--steps", type=int, default=1_000_000)
    parser.add_argument("--layers", type=int, default=200)
    parser.add_argument("--samples", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    args = tiny.parse_args(parser, steps=2000, layers=10, samples=10)
    start = time.perf_counter()
    run_dir = os.path.join(args.logdir, "synthetic_large", schema.TRAIN_RUN)
    write_synthetic_run(
        run_dir,
        steps=args.steps,
        layers=args.layers,
        samples=args.samples,
        seed=args.seed,
    )
    size = sum(
        os.path.getsize(os.path.join(run_dir, name)) for name in os.listdir(run_dir)
    )
    print(
        f"wrote {run_dir}: {size / 1e6:.1f} MB in {time.perf_counter() - start:.1f} s"
    )


if __name__ == "__main__":
    main()
