"""What per-layer numerics cost on JAX, per step, by the way they leave the step.

On the seed model (784-256-10 MLP, mixed_float16, batch 128, CPU) it times,
in alternating blocks of steps (each block ends when its state is ready):

- plain: Keras' own jitted `train_step`;
- mpprof: the instrumented step mpprof runs on sampled steps (forward and
  upstream-gradient statistics of every layer, variable gradients scaled and
  unscaled, all leaving as outputs of the jitted step);
- debug.callback: the same per-layer information by host callbacks, as a
  user would write it: each layer's output and the gradient flowing into it
  (through a custom-VJP identity) and each variable's gradient, their rows
  computed on the device and sent by `jax.debug.callback`;
- debug.callback (forward only): just the forward rows that way;
- checkify: `checkify.float_checks` over the step, its error read after each
  step (what finding the first non-finite value that way costs).

Each variant's cost is its paired ratio less 1; the last column says how many
times mpprof's cost each variant's is. `--clock cpu` times the process's CPU
time instead of the wall clock: steadier on a shared machine, where the wall
clock also counts other processes' turns.

    KERAS_BACKEND=jax python benchmarks/bench_numerics_jax.py --rounds 40
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time
import types

os.environ["KERAS_BACKEND"] = "jax"

import jax
import keras
import numpy as np
import tiny  # benchmarks/, on the path when run as a script
from jax.experimental import checkify

from mpprof.backends.jax.numerics_taps import NumericsTaps
from mpprof.backends.jax.tensor_statistics import raw_statistics
from mpprof.backends.layer_casts import LayerCallPatch
from mpprof.backends.patching import Patches

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
    """A layer hook sending each leaf layer's statistics rows to the host:
    its output's, and (with `backward`) the gradient's flowing into it."""

    def __init__(self, backward: bool):
        self.rows = []
        self._backward = backward

    def on_call(self, layer, args, kwargs, outputs):
        if not isinstance(outputs, jax.Array) or list(layer._flatten_layers(include_self=False)):
            return outputs
        jax.debug.callback(self.rows.append, raw_statistics(jax.lax.stop_gradient(outputs)))
        return _send_gradient(outputs, self.rows.append) if self._backward else outputs


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _send_gradient(x, send):
    return x


def _send_gradient_fwd(x, send):
    return x, None


def _send_gradient_bwd(send, _, gradient):
    jax.debug.callback(send, raw_statistics(gradient))
    return (gradient,)


_send_gradient.defvjp(_send_gradient_fwd, _send_gradient_bwd)


def _traced_anew(model):
    """`model.train_step` as a new function: JAX caches a function's trace by
    the function, so jitting `model.train_step` again would reuse the trace
    `fit` made, without the hooks installed since."""
    return lambda state, data: model.train_step(state, data)


def _with_gradient_rows(model, send):
    """`model.train_step` whose optimizer also sends each variable's
    gradient row (scaled, as the optimizer gets it)."""
    apply = model.optimizer.stateless_apply

    def stateless_apply(optimizer_variables, grads, trainable_variables):
        for gradient in grads:
            jax.debug.callback(send, raw_statistics(gradient))
        return apply(optimizer_variables, grads, trainable_variables)

    model.optimizer.stateless_apply = stateless_apply
    return _traced_anew(model)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--block", type=int, default=10)
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    args = tiny.parse_args(parser, rounds=2, block=2)
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    rng = np.random.default_rng(0)
    x = rng.random((BATCH_SIZE * 4, 784), dtype=np.float32)
    y = rng.integers(0, 10, BATCH_SIZE * 4)
    data = (jax.numpy.asarray(x[:BATCH_SIZE]), jax.numpy.asarray(y[:BATCH_SIZE]))
    arms = {}
    hooks = {}

    model = _model()
    model.fit(x, y, batch_size=BATCH_SIZE, verbose=0)
    arms["plain"] = (jax.jit(model.train_step, donate_argnums=0), _state(model))

    model = _model()
    model.fit(x, y, batch_size=BATCH_SIZE, verbose=0)
    # No float8 layers: the numerics are the step's only taps.
    taps = NumericsTaps(model, types.SimpleNamespace(step_taps=[]))
    LayerCallPatch(model, [taps]).install(Patches())
    arms["mpprof"] = (jax.jit(taps.instrumented_train_step, donate_argnums=0), _state(model))

    for name, backward in (("debug.callback", True), ("debug.callback fwd", False)):
        model = _model()
        model.fit(x, y, batch_size=BATCH_SIZE, verbose=0)
        hook = _CallbackStats(backward)
        LayerCallPatch(model, [hook]).install(Patches())
        step = _with_gradient_rows(model, hook.rows.append) if backward else _traced_anew(model)
        arms[name] = (jax.jit(step, donate_argnums=0), _state(model))
        hooks[name] = (hook, (2 + 2 + 4) if backward else 2)  # rows a step sends

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
            start = clock()
            state = states[name]
            for _ in range(args.block):
                _, state = functions[name](state, data)
            jax.block_until_ready(state)
            states[name] = state
            times[name].append((clock() - start) / args.block)
    jax.effects_barrier()
    for name, (hook, per_step) in hooks.items():
        # Every step ran its callbacks: the arm measured what it says.
        assert len(hook.rows) == per_step * (1 + args.rounds * args.block), (name, len(hook.rows))
    plain = times["plain"]
    ratios = {name: statistics.median(t / p for t, p in zip(series, plain, strict=True))
              for name, series in times.items()}
    mpprof_cost = ratios["mpprof"] - 1
    print(f"{'variant':20s} {'us/step':>8s} {'paired ratio':>12s} {'cost / mpprof':>14s}")
    for name, series in times.items():
        multiple = (ratios[name] - 1) / mpprof_cost if name != "plain" and mpprof_cost > 0 else None
        print(f"{name:20s} {statistics.median(series) * 1e6:8.0f} {ratios[name]:12.2f} "
              f"{'' if multiple is None else f'{multiple:.1f}x':>14s}")
    print(f"\n{args.rounds} rounds of {args.block} steps, {args.clock} clock, seed model, "
          f"mixed_float16, batch {BATCH_SIZE}, {jax.devices()[0].platform}; "
          f"load {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
