"""A deliberately unstable mixed_float16 run: a gradient overflow storm.

Regression to targets of 1000 with an initial loss scale of 2**30: the scaled
gradients overflow float16 step after step, the LossScaleOptimizer halves the
scale and skips each of those steps until the scale is small enough. mpprof
records every overflow at its exact step.

    python examples/overflow_storm.py --log-dir logs/overflow_storm
"""

import argparse

import keras
import numpy as np

import mpprof


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--log-dir", default="logs/overflow_storm")
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()

    keras.mixed_precision.set_dtype_policy("mixed_float16")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2048, 64)).astype("float32")
    y = np.full((2048, 1), 1000.0, dtype="float32")
    model = keras.Sequential([
        keras.layers.Input((64,)),
        keras.layers.Dense(128, activation="relu"),
        keras.layers.Dense(1, dtype="float32"),
    ])
    optimizer = keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(1e-4), initial_scale=2.0**30, dynamic_growth_steps=20
    )
    model.compile(optimizer=optimizer, loss="mse")
    model.fit(
        x, y, batch_size=64, epochs=args.epochs, verbose=2,
        callbacks=[mpprof.MixedPrecisionProfiler(log_dir=args.log_dir)],
    )


if __name__ == "__main__":
    main()
