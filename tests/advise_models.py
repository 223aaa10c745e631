"""Planted models for the precision advisor's tests (Keras 3, any backend).

Each `build(dtypes)` makes the model with the run's policy (mixed_float16,
set by `planted`) and, per layer name, the policy `dtypes` gives (the plan
applied: `plan_dtypes`); each model plants a reason the plan must name:

    mlp         "island": a float32 Dense whose values fit float16 (lower it)
    overflow    "hot": a float32 island with values within 16x of 65504
                (keep it), "boom": a float16 Dense that overflows (float32)
    cnn         "conv_island": a needless float32 Conv2D (lower it)
    transformer "ffn_island": a needless float32 Dense after attention
    lstm        "lstm": a needless float32 LSTM (lower it)
    hub         "pooled_island": a needless float32 Dense on a keras-hub
                BertBackbone built from a config (no download)
    float8      "f2", "f3": Dense layers of 64 (multiples of 16) whose input
                and gradient fit float8 at amax scaling (float8 candidates)
    healthy     nothing to change

`EXPECTED[name]` says what the plan must hold. `LOOK_ALIKES` are healthy
models shaped like a planted one, whose plan must change nothing:

    cross_attention  a MultiHeadAttention and a keras.layers.Attention
                     from 6 queries to 10 keys (not multiples of 8), all
                     mixed_float16, no float32 island
"""

from __future__ import annotations

import keras
import numpy as np

POLICY = "mixed_float16"

EXPECTED = {
    "mlp": {"lower": {"island"}, "float32": set(), "float8": set()},
    "overflow": {"lower": set(), "float32": {"boom"}, "stay": {"hot"}, "float8": set()},
    "cnn": {"lower": {"conv_island"}, "float32": set(), "float8": set()},
    "transformer": {"lower": {"ffn_island"}, "float32": set(), "float8": set()},
    "lstm": {"lower": {"lstm"}, "float32": set(), "float8": set()},
    "hub": {"lower": {"pooled_island"}, "float32": set(), "float8": set()},
    "float8": {"lower": set(), "float32": set(), "float8": {"f2", "f3"}},
    "healthy": {"lower": set(), "float32": set(), "float8": set()},
}


def _dense(units, name, dtypes, default=None, **kwargs):
    return keras.layers.Dense(units, name=name, dtype=dtypes.get(name, default), **kwargs)


def mlp(dtypes):
    inputs = keras.Input((16,))
    h = _dense(40, "hidden", dtypes, activation="relu")(inputs)
    h = _dense(40, "island", dtypes, "float32", activation="relu")(h)
    h = _dense(24, "hidden2", dtypes, activation="relu")(h)
    return keras.Model(inputs, _dense(4, "out", dtypes, "float32")(h))


def overflow(dtypes):
    constant = keras.initializers.Constant
    inputs = keras.Input((16,))
    # ones in: 16 x 300 = 4800 per unit (13.6x under 65504), then 8 x 4800 x 4
    # = 153600, past float16's max.
    h = _dense(8, "hot", dtypes, "float32", kernel_initializer=constant(300.0))(inputs)
    h = _dense(8, "boom", dtypes, kernel_initializer=constant(4.0))(h)
    return keras.Model(inputs, _dense(1, "out", dtypes, "float32",
                                      kernel_initializer=constant(1e-5))(h))


def cnn(dtypes):
    inputs = keras.Input((8, 8, 3))
    h = keras.layers.Conv2D(8, 3, name="conv1", activation="relu",
                            dtype=dtypes.get("conv1"))(inputs)
    h = keras.layers.Conv2D(8, 3, name="conv_island", activation="relu",
                            dtype=dtypes.get("conv_island", "float32"))(h)
    h = keras.layers.GlobalAveragePooling2D(name="pool")(h)
    return keras.Model(inputs, _dense(4, "out", dtypes, "float32")(h))


def transformer(dtypes):
    inputs = keras.Input((8, 16))
    attended = keras.layers.MultiHeadAttention(2, 8, name="mha")(inputs, inputs)
    h = keras.layers.LayerNormalization(name="ln")(keras.layers.Add()([inputs, attended]))
    h = _dense(40, "ffn_island", dtypes, "float32", activation="relu")(h)
    h = _dense(16, "ffn_out", dtypes)(h)
    h = keras.layers.GlobalAveragePooling1D(name="pool")(h)
    return keras.Model(inputs, _dense(4, "out", dtypes, "float32")(h))


def lstm(dtypes):
    inputs = keras.Input((6, 8))
    h = keras.layers.LSTM(16, name="lstm", return_sequences=True,
                          dtype=dtypes.get("lstm", "float32"))(inputs)
    h = keras.layers.GlobalAveragePooling1D(name="pool")(h)
    return keras.Model(inputs, _dense(4, "out", dtypes, "float32")(h))


def hub(dtypes):
    import keras_hub

    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=64, num_layers=1, num_heads=2, hidden_dim=16, intermediate_dim=32,
        max_sequence_length=8, name="bert")
    outputs = backbone.output["pooled_output"]
    h = _dense(40, "pooled_island", dtypes, "float32", activation="relu")(outputs)
    return keras.Model(backbone.input, _dense(4, "out", dtypes, "float32")(h))


def float8(dtypes):
    inputs = keras.Input((64,))
    h = _dense(64, "f1", dtypes, activation="relu")(inputs)
    h = _dense(64, "f2", dtypes, activation="relu")(h)
    h = _dense(64, "f3", dtypes, activation="relu")(h)
    return keras.Model(inputs, _dense(4, "out", dtypes, "float32")(h))


def healthy(dtypes):
    inputs = keras.Input((12,))
    h = _dense(24, "h1", dtypes, activation="relu")(inputs)
    h = _dense(24, "h2", dtypes, activation="relu")(h)
    return keras.Model(inputs, _dense(4, "out", dtypes, "float32")(h))


def cross_attention(dtypes):
    queries, context = keras.Input((6, 16), name="queries"), keras.Input((10, 16), name="context")
    attended = keras.layers.MultiHeadAttention(2, 8, name="cross")(queries, context)
    q = _dense(16, "q", dtypes)(queries)
    v = _dense(16, "v", dtypes)(context)
    dot = keras.layers.Attention(name="dot")([q, v])
    h = keras.layers.Add(name="sum")([attended, dot])
    h = keras.layers.GlobalAveragePooling1D(name="pool")(h)
    return keras.Model([queries, context], _dense(4, "out", dtypes, "float32")(h))


LOOK_ALIKES = {"cross_attention": cross_attention}

BUILDERS = {"mlp": mlp, "overflow": overflow, "cnn": cnn, "transformer": transformer,
            "lstm": lstm, "hub": hub, "float8": float8, "healthy": healthy}

# The retraining's learning rates: the overflow model's kernels are huge
# constants, which Adam's unit-sized steps would blow up at 1e-2.
LEARNING_RATES = {"overflow": 1e-6}

SAMPLES = 64
BATCH = 8


def data(name: str):
    """(x, y) for the model (fixed seed: both backends see the same data)."""
    rng = np.random.default_rng(0)
    if name == "overflow":
        return np.ones((SAMPLES, 16), "float32"), np.ones((SAMPLES, 1), "float32")
    if name == "cross_attention":
        x = [rng.normal(size=(SAMPLES, 6, 16)).astype("float32"),
             rng.normal(size=(SAMPLES, 10, 16)).astype("float32")]
        return x, rng.normal(size=(SAMPLES, 4)).astype("float32")
    if name == "hub":
        x = {"token_ids": rng.integers(1, 64, (SAMPLES, 8)).astype("int32"),
             "segment_ids": np.zeros((SAMPLES, 8), "int32"),
             "padding_mask": np.ones((SAMPLES, 8), "int32")}
        return x, rng.normal(size=(SAMPLES, 4)).astype("float32")
    shapes = {"mlp": (16,), "cnn": (8, 8, 3), "transformer": (8, 16), "lstm": (6, 8),
              "float8": (64,), "healthy": (12,)}
    x = rng.normal(size=(SAMPLES, *shapes[name])).astype("float32")
    return x, rng.normal(size=(SAMPLES, 4 if name != "overflow" else 1)).astype("float32")


def planted(name: str, dtypes: dict | None = None, policy: str = POLICY):
    """The planted model `name`, compiled, under `policy`."""
    keras.mixed_precision.set_dtype_policy(policy)
    try:
        model = {**BUILDERS, **LOOK_ALIKES}[name](dtypes or {})
    finally:
        keras.mixed_precision.set_dtype_policy("float32")
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    return model


def plan_dtypes(plan: dict) -> dict[str, str]:
    """The plan's policy per layer name, for `planted(name, dtypes)`."""
    half = plan["half_dtype"]
    found = {}
    for row in plan["rows"]:
        dtype = half if row["planned"] == "float8" else row["planned"]
        found[row["layer"].rpartition("/")[2]] = (
            "float32" if dtype == "float32" else f"mixed_{dtype}")
    return found


def fit_planted(name: str, logdir, advise_batches: int = 2, policy: str = POLICY) -> dict:
    """Trains the planted model `name` under `policy` and the profiler
    (numerics every step, `advise_batches` kept) and returns
    `mpprof.advise(logdir)`."""
    import mpprof

    model = planted(name, policy=policy)
    x, y = data(name)
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, shuffle=False,
              callbacks=[mpprof.MixedPrecisionProfiler(
                  str(logdir), numerics_every=1, gpu_interval=None,
                  advise_batches=advise_batches)])
    return mpprof.advise(str(logdir))


def retrain(name: str, dtypes: dict | None, policy: str, float8: list[str],
            steps: int = 20, initial=None) -> tuple[list[float], list]:
    """`steps` train_on_batch steps of the planted model with these policies
    (float8: `model.quantize` filters), from `initial` weights when given;
    the loss of each step and the weights it started from. Seeded: both
    retrains' dropout layers (the BERT's) start from the same seeds, as the
    verification's trial does (`replay_candidates.repeatable_random_draws`);
    unseeded, their masks followed whatever ran before in the process."""
    keras.utils.set_random_seed(0)
    model = planted(name, dtypes, policy)
    trainable = list(model.trainable_weights)
    if initial is None:
        initial = [keras.ops.convert_to_numpy(v) for v in trainable]
    else:
        for variable, value in zip(trainable, initial, strict=True):
            variable.assign(value)
    if float8:
        model.quantize("float8", filters=float8)
    # Recompiled after quantize (it adds variables), a fresh optimizer either way.
    model.compile(optimizer=keras.optimizers.Adam(LEARNING_RATES.get(name, 1e-2)), loss="mse")
    x, y = data(name)
    losses = []
    for step in range(steps):
        rows = slice((step % 2) * BATCH, (step % 2 + 1) * BATCH)
        xb = {k: v[rows] for k, v in x.items()} if isinstance(x, dict) else x[rows]
        losses.append(float(model.train_on_batch(xb, y[rows])))
    return losses, initial


if __name__ == "__main__":
    # The JAX half of the parity test: KERAS_BACKEND=jax python
    # tests/advise_models.py OUT_DIR NAME... writes OUT_DIR/plans.json.
    import json
    import os
    import sys

    out, names = sys.argv[1], sys.argv[2:]
    plans = {}
    for model_name in names:
        advice = fit_planted(model_name, os.path.join(out, model_name))
        plans[model_name] = {key: advice["plan"][key] for key in (
            "must_float32", "lower", "float8", "nothing_to_change", "policy_map")}
    with open(os.path.join(out, "plans.json"), "w") as f:
        json.dump(plans, f)
