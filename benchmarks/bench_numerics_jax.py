"""What per-layer numerics cost on JAX, per step, by the way they leave the step.

On the seed model (784-256-10 MLP, mixed_float16, batch 128, CPU) it times,
in alternating blocks of steps (each block ends when its state is ready):

- plain: Keras' own jitted `train_step`;
- mpprof: the instrumented step mpprof runs on sampled steps (forward and
  upstream-gradient statistics of every layer, variable gradients scaled and
  unscaled, all leaving as outputs of the jitted step);
- debug.callback: the same forward statistics computed on the device, each
  layer's row sent to the host by `jax.debug.callback` (a host callback per
  layer per step; no gradients);
- checkify: `checkify.float_checks` over the step, its error read after each
  step (what finding the first non-finite value that way costs).

    KERAS_BACKEND=jax python benchmarks/bench_numerics_jax.py --rounds 40
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ["KERAS_BACKEND"] = "jax"

import jax
import keras
import numpy as np
from jax.experimental import checkify

from mpprof.backends.jax.layer_calls import LayerCallPatch
from mpprof.backends.jax.numerics_taps import NumericsTaps
from mpprof.backends.jax.tensor_statistics import raw_statistics
from mpprof.recording.patching import Patches

BATCH_SIZE = 128


def _model() -> keras.Model:
    model = keras.Sequential([
        keras.layers.Input((784,)),
        keras.layers.Dense(256, activation="relu"),
        keras.layers.Dense(10, dtype="float32"),
    ])
    model.compile(optimizer="adam",
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _state(model):
    state = model._get_jax_state(trainable_variables=True, non_trainable_variables=True,
                                 optimizer_variables=True, metrics_variables=True)
    return jax.tree.map(lambda a: a.copy(), state)


class _CallbackStats:
    """A layer hook sending each layer's statistics row to the host."""

    def __init__(self):
        self.rows = []

    def on_call(self, layer, args, kwargs, outputs):
        if isinstance(outputs, jax.Array) and not layer._flatten_layers(include_self=False):
            jax.debug.callback(self.rows.append, raw_statistics(jax.lax.stop_gradient(outputs)))
        return outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--block", type=int, default=10)
    args = parser.parse_args()
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    rng = np.random.default_rng(0)
    x = rng.random((BATCH_SIZE * 4, 784), dtype=np.float32)
    y = rng.integers(0, 10, BATCH_SIZE * 4)
    data = (jax.numpy.asarray(x[:BATCH_SIZE]), jax.numpy.asarray(y[:BATCH_SIZE]))
    arms = {}

    model = _model()
    model.fit(x, y, batch_size=BATCH_SIZE, verbose=0)
    arms["plain"] = (jax.jit(model.train_step, donate_argnums=0), _state(model))

    model = _model()
    model.fit(x, y, batch_size=BATCH_SIZE, verbose=0)
    taps = NumericsTaps(model, type("Backend", (), {})())
    LayerCallPatch(model, [taps]).install(Patches())
    arms["mpprof"] = (jax.jit(taps.instrumented_train_step, donate_argnums=0), _state(model))

    model = _model()
    model.fit(x, y, batch_size=BATCH_SIZE, verbose=0)
    hook = _CallbackStats()
    LayerCallPatch(model, [hook]).install(Patches())
    arms["debug.callback"] = (jax.jit(model.train_step, donate_argnums=0), _state(model))

    model = _model()
    model.fit(x, y, batch_size=BATCH_SIZE, verbose=0)
    checked = jax.jit(checkify.checkify(model.train_step, errors=checkify.float_checks),
                      donate_argnums=0)

    def checkify_step(state, batch):
        error, result = checked(state, batch)
        error.throw()  # the host must look at every step's error
        return result

    arms["checkify"] = (checkify_step, _state(model))

    functions = {name: f for name, (f, _) in arms.items()}
    states = {name: s for name, (_, s) in arms.items()}
    for name in arms:  # compile
        _, states[name] = functions[name](states[name], data)
    times = {name: [] for name in arms}
    names = list(arms)
    for round_index in range(args.rounds):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            start = time.perf_counter()
            state = states[name]
            for _ in range(args.block):
                _, state = functions[name](state, data)
            jax.block_until_ready(state)
            states[name] = state
            times[name].append((time.perf_counter() - start) / args.block)
    plain = times["plain"]
    print(f"{'variant':16s} {'us/step':>8s} {'paired ratio':>12s}")
    for name, series in times.items():
        ratio = statistics.median(t / p for t, p in zip(series, plain, strict=True))
        print(f"{name:16s} {statistics.median(series) * 1e6:8.0f} {ratio:12.2f}")
    print(f"\n{args.rounds} rounds of {args.block} steps, seed model, mixed_float16, "
          f"batch {BATCH_SIZE}, {jax.devices()[0].platform}; load {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
