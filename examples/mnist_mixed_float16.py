"""The seed example: Dense(256) -> Dense(10) on MNIST under mixed_float16.

Trains with `mpprof.MixedPrecisionProfiler` and writes its records (and
keras.callbacks.TensorBoard's) to --log-dir. Offline, MNIST cannot be
downloaded: the example then trains on synthetic MNIST-shaped data and says so.

    python examples/mnist_mixed_float16.py --log-dir logs/mnist_mixed_float16
"""

import argparse
import socket

import keras
import numpy as np

import mpprof


def load_mnist(samples: int):
    """MNIST as flat float32 images in [0, 1], or synthetic data when offline."""
    socket.setdefaulttimeout(10)
    try:
        (x, y), _ = keras.datasets.mnist.load_data()
        x = x.reshape(-1, 784).astype("float32") / 255.0
        return x[:samples], y[:samples]
    except Exception as e:  # noqa: BLE001 - any download failure means offline
        print(f"NOTICE: MNIST could not be downloaded ({type(e).__name__}); "
              "training on synthetic MNIST-shaped data instead.")
        rng = np.random.default_rng(0)
        y = rng.integers(0, 10, samples)
        centers = rng.random((10, 784)).astype("float32")
        x = np.clip(centers[y] + 0.3 * rng.standard_normal((samples, 784)), 0, 1)
        return x.astype("float32"), y


def build_model() -> keras.Model:
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    model = keras.Sequential([
        keras.layers.Input((784,)),
        keras.layers.Dense(256, activation="relu"),
        # The logits stay float32 so the loss sees full precision (MP006).
        keras.layers.Dense(10, dtype="float32"),
    ])
    model.compile(
        optimizer="adam",
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--log-dir", default="logs/mnist_mixed_float16")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--samples", type=int, default=8192)
    parser.add_argument("--numerics-every", type=int, default=16,
                        help="sample per-layer numerics every N steps (dense, for the demo)")
    parser.add_argument("--verbose", type=int, default=2, help="model.fit's verbose")
    args = parser.parse_args()
    x, y = load_mnist(args.samples)
    model = build_model()
    model.fit(
        x, y, batch_size=128, epochs=args.epochs, validation_split=0.1,
        callbacks=[
            keras.callbacks.TensorBoard(log_dir=args.log_dir),
            mpprof.MixedPrecisionProfiler(log_dir=args.log_dir,
                                          numerics_every=args.numerics_every),
        ],
        verbose=args.verbose,
    )


if __name__ == "__main__":
    main()
