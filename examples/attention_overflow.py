"""A real float16 fault of one layer: attention scores overflow on unnormalised batches.

A sequence classifier (Dense projection -> dot-product Attention -> pooling ->
float32 logits) trains under mixed_float16 on sensor readings. Most batches
are normalised, but a few come from a sensor logged in raw units (RAW_GAIN
times larger). The projection's outputs stay far below the float16 maximum;
the Attention layer's unscaled query-key dot products, quadratic in the input
scale, exceed 65504 on those batches: its softmax turns them into NaN, the
loss is NaN and the loss scale skips the step.

    python examples/attention_overflow.py --log-dir logs/attention_overflow
    python examples/attention_overflow.py --log-dir logs/attention_fixed --fix
    KERAS_BACKEND=jax python examples/attention_overflow.py --log-dir logs/attention_overflow_jax

`--fix` applies what `mpprof diagnose --replay` suggests: the Attention layer
computes in float32 (a keras.dtype_policies.DTypePolicyMap entry), every other
layer stays in mixed_float16.
"""

import argparse

import keras
import numpy as np

import mpprof

STEPS, FEATURES, UNITS = 16, 16, 128
BATCH, BATCHES = 32, 64
# Batches 20 and 21 of each epoch come from the raw-unit sensor. Two in a row:
# on TensorFlow the overflow on the first arms a forensic sample of the
# second, so the sampled step itself overflows (and is captured for the
# replay); on JAX the sample is of the first (its batch is kept).
RAW_BATCHES, RAW_GAIN = (20, 21), 100.0


def make_data(seed: int = 0):
    """Seeded sequences; the label says whether feature 0's mean is positive."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((BATCH * BATCHES, STEPS, FEATURES)).astype("float32")
    y = (x[:, :, 0].mean(axis=1) > 0).astype("int32")
    for b in RAW_BATCHES:
        x[b * BATCH:(b + 1) * BATCH] *= RAW_GAIN
    return x, y


def build_model(fix: bool) -> keras.Model:
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    # The per-layer fix: a policy map keyed by the layer's path. Layers not in
    # the map take its default policy.
    policy = None
    if fix:
        policy = keras.dtype_policies.DTypePolicyMap(default_policy="mixed_float16")
        policy["attention"] = "float32"
    inputs = keras.layers.Input((STEPS, FEATURES))
    h = keras.layers.Dense(UNITS, name="embed")(inputs)
    h = keras.layers.Attention(name="attention", dtype=policy)([h, h])
    h = keras.layers.GlobalAveragePooling1D(name="pool")(h)
    # The logits stay float32 so the loss sees full precision (MP006).
    outputs = keras.layers.Dense(2, name="logits", dtype="float32")(h)
    model = keras.Model(inputs, outputs)
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--log-dir", default="logs/attention_overflow")
    parser.add_argument("--fix", action="store_true",
                        help="compute the Attention layer in float32")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--verbose", type=int, default=2, help="model.fit's verbose")
    args = parser.parse_args()
    keras.utils.set_random_seed(0)
    x, y = make_data()
    model = build_model(args.fix)
    model.fit(
        x, y, batch_size=BATCH, epochs=args.epochs, shuffle=False, verbose=args.verbose,
        callbacks=[
            keras.callbacks.TensorBoard(log_dir=args.log_dir),
            # advise_batches: 4 of the run's own batches, spread across it, for
            # `mpprof advise --verify` to check its plan on.
            mpprof.MixedPrecisionProfiler(log_dir=args.log_dir, numerics_every=16,
                                          advise_batches=4),
        ],
    )


if __name__ == "__main__":
    main()
