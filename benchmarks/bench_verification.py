"""How far healthy float16/bfloat16 steps are from float32: the numbers behind
`mpprof.replay.verification.TOLERANCES` and the trial's band, and what a
verification costs.

Healthy models (nothing overflows), each trained a few steps under the
policy and then verified as they are (the run's own policy as the candidate)
on one batch, exactly as a replay verifies a fix: the largest relative error
of the loss, of a variable's unscaled gradient and of a layer's output
against float32, the headroom the half-precision layers keep (how many times
under their dtype's max their largest output is: the tightest layer's), and
the 30-step trial (decrease ratio, mean difference).

    python benchmarks/bench_verification.py                  # TensorFlow
    KERAS_BACKEND=jax python benchmarks/bench_verification.py
    python benchmarks/bench_verification.py --policies mixed_float16
    python benchmarks/bench_verification.py --tiny   # a smoke test: one model, one policy
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))

import tiny  # benchmarks/, on the path when run as a script

from mpprof.backends import replay_engines
from mpprof.replay import verification


def seed_mlp():
    """The seed model (examples/mnist_mixed_float16.py), random data."""
    model = keras.Sequential([
        keras.layers.Input((784,)), keras.layers.Dense(256, activation="relu"),
        keras.layers.Dense(10, dtype="float32")])
    model.compile(optimizer="adam",
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(0)
    return model, rng.random((256, 784), "float32"), rng.integers(0, 10, 256)


def attention():
    """examples/attention_overflow.py's model on normalised batches."""
    import attention_overflow

    model = attention_overflow.build_model(fix=False)
    x, y = attention_overflow.make_data()
    return model, x[:256], y[:256]


def mnist_convnet():
    """keras-io's mnist_convnet (as published), inputs in [0, 1]."""
    model = keras.Sequential([
        keras.Input(shape=(28, 28, 1)),
        keras.layers.Conv2D(32, kernel_size=(3, 3), activation="relu"),
        keras.layers.MaxPooling2D(pool_size=(2, 2)),
        keras.layers.Conv2D(64, kernel_size=(3, 3), activation="relu"),
        keras.layers.MaxPooling2D(pool_size=(2, 2)),
        keras.layers.Flatten(), keras.layers.Dropout(0.5),
        keras.layers.Dense(10, activation="softmax")])
    model.compile(loss="categorical_crossentropy", optimizer="adam")
    rng = np.random.default_rng(0)
    x = rng.integers(0, 65536, (128, 28, 28, 1)).astype("float32") / 65535
    return model, x, keras.utils.to_categorical(rng.integers(0, 10, 128), 10)


def lstm():
    """A small LSTM sequence classifier."""
    model = keras.Sequential([
        keras.Input((20, 8)), keras.layers.LSTM(32),
        keras.layers.Dense(2, dtype="float32")])
    model.compile(optimizer="adam",
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((128, 20, 8)).astype("float32")
    return model, x, (x[:, :, 0].mean(axis=1) > 0).astype("int32")


MODELS = {"seed_mlp": seed_mlp, "attention": attention, "mnist_convnet": mnist_convnet,
          "lstm": lstm}


def measure(name: str, policy: str, batch_size: int) -> dict:
    keras.utils.set_random_seed(0)
    keras.mixed_precision.set_dtype_policy(policy)
    model, x, y = MODELS[name]()
    model.fit(x, y, batch_size=batch_size, epochs=1, verbose=0)
    optimizer = model.optimizer
    scale = (float(keras.ops.convert_to_numpy(optimizer.dynamic_scale))
             if isinstance(optimizer, keras.optimizers.LossScaleOptimizer) else 1.0)
    engine = replay_engines.verification_engine(
        model, [(x[:batch_size], y[:batch_size])], scale)
    start = time.perf_counter()
    result = verification.Verifier(engine).verify(
        verification.Candidate(label="the run's own policy"))
    seconds = time.perf_counter() - start
    step = result.step[0]
    trial = result.trial
    return {"model": name, "policy": policy, "verified": result.verified,
            "loss": step.loss_rel_error, "gradient": step.gradient_rel_error,
            "worst_gradient": step.worst_gradient, "output": step.output_rel_error,
            "worst_output": step.worst_output,
            "headroom": step.headroom["factor"] if step.headroom else None,
            "tightest": step.headroom["layer"] if step.headroom else None,
            "progress": trial.progress if trial else None,
            "mean_diff": trial.mean_rel_diff if trial else None, "seconds": seconds,
            "detail": result.detail}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--policies", nargs="+", default=["mixed_float16", "mixed_bfloat16"])
    parser.add_argument("--batch-size", type=int, default=32)
    args = tiny.parse_args(parser, models=["seed_mlp"], policies=["mixed_float16"])
    print(f"backend {keras.backend.backend()}; tolerances {verification.TOLERANCES}; "
          f"trial {verification.trial_band()}")
    print(f"{'model':14} {'policy':15} {'loss':>8} {'gradient':>9} {'output':>8} "
          f"{'headroom':>9} {'progress':>8} {'mean':>7} {'s':>5}  verified")
    for name in args.models:
        for policy in args.policies:
            row = measure(name, policy, args.batch_size)
            progress = "-" if row["progress"] is None else f"{row['progress']:.2f}"
            mean = "-" if row["mean_diff"] is None else f"{row['mean_diff']:.3f}"
            room = "-" if row["headroom"] is None else f"{row['headroom']:.3g}"
            print(f"{name:14} {policy:15} {row['loss']:8.2g} {row['gradient']:9.2g} "
                  f"{row['output']:8.2g} {room:>9} {progress:>8} {mean:>7} "
                  f"{row['seconds']:5.1f}  {row['verified']} (worst gradient "
                  f"{row['worst_gradient']}, output {row['worst_output']}, tightest "
                  f"{row['tightest']})")
            if not row["verified"]:
                print(f"    {row['detail']}")


if __name__ == "__main__":
    main()
