"""Keras 3 models whose `train_step(self, state, data)` is the user's own, on
JAX: the keras.io recipe (`stateless_call`, `jax.value_and_grad`,
`optimizer.stateless_apply`, metrics updated statelessly), and a GAN with
two optimizers.

Keras' JAX `fit` passes only `model.optimizer.variables` in the state's
optimizer slot, and a layer does not track an optimizer. The GAN keeps its
two optimizers' variables in a list attribute, which the model tracks as
non-trainable variables: `fit` then hands them to the step in `state[1]` and
writes the step's new values back at epoch ends, like any other state.
"""

from __future__ import annotations

import jax
import keras
import numpy as np


def _stateless_metrics(model, metrics_variables, values: dict):
    """Updates each of `model.metrics` with `values[metric.name]`,
    statelessly; returns (logs, new metrics variables)."""
    logs, new, start = {}, [], 0
    for metric in model.metrics:
        count = len(metric.variables)
        own = metric.stateless_update_state(metrics_variables[start:start + count],
                                            values[metric.name])
        logs[metric.name] = metric.stateless_result(own)
        new += own
        start += count
    return logs, new


class CustomStepRegressor(keras.Model):
    """Dense layers and a keras.io-style JAX `train_step` with the compiled
    optimizer. `kernel` initialises the two float16 layers (a large constant
    overflows the second one's output: 300 * 300 * 8 > 65504)."""

    def __init__(self, kernel="glorot_uniform", **kwargs):
        super().__init__(**kwargs)
        self.first = keras.layers.Dense(16, kernel_initializer=kernel, name="first")
        self.second = keras.layers.Dense(16, kernel_initializer=kernel, name="second")
        self.dropout = keras.layers.Dropout(0.25, name="dropout")
        self.head = keras.layers.Dense(1, dtype="float32", name="head")
        self.loss_tracker = keras.metrics.Mean(name="loss")

    def call(self, x, training=False):
        return self.head(self.dropout(self.second(self.first(x)), training=training))

    @property
    def metrics(self):
        return [self.loss_tracker]

    def _loss(self, trainable, non_trainable, x, y, optimizer_variables):
        y_pred, non_trainable = self.stateless_call(trainable, non_trainable, x,
                                                    training=True)
        loss = keras.ops.mean(keras.ops.square(y_pred - y))
        # The loss scale of a LossScaleOptimizer, read from the step's state.
        mapping = list(zip(self.optimizer.variables, optimizer_variables, strict=True))
        with keras.StatelessScope(state_mapping=mapping):
            scaled = self.optimizer.scale_loss(loss)
        return scaled, (loss, non_trainable)

    def train_step(self, state, data):
        trainable, non_trainable, optimizer_variables, metrics_variables = state
        x, y = data
        (_, (loss, non_trainable)), grads = jax.value_and_grad(self._loss, has_aux=True)(
            trainable, non_trainable, x, y, optimizer_variables)
        trainable, optimizer_variables = self.optimizer.stateless_apply(
            optimizer_variables, grads, trainable)
        logs, metrics_variables = _stateless_metrics(self, metrics_variables, {"loss": loss})
        return logs, (trainable, non_trainable, optimizer_variables, metrics_variables)


class Gan(keras.Model):
    """A GAN: a generator, a discriminator, one optimizer each
    (`model.optimizer` unused). `g_kernel` initialises the generator's
    float16 layers (a large constant overflows `g_out`), `d_kernel` the
    discriminator's hidden layer. At the discriminator optimizer's apply
    count `nonfinite_d_loss_at` the d_loss the step reports is +inf (its
    gradients stay finite: the case no loss scale catches); at
    `nonfinite_g_loss_at` the generator's loss is multiplied by +inf before
    its gradients are taken (they are non-finite: g_opt skips the step)."""

    def __init__(self, g_kernel="glorot_uniform", d_kernel="glorot_uniform",
                 nonfinite_d_loss_at=None, nonfinite_g_loss_at=None, **kwargs):
        super().__init__(**kwargs)
        self.nonfinite_d_loss_at = nonfinite_d_loss_at
        self.nonfinite_g_loss_at = nonfinite_g_loss_at
        self.seeds = keras.random.SeedGenerator(1)
        self.generator = keras.Sequential([
            keras.layers.Input((4,)),
            keras.layers.Dense(8, activation="relu", kernel_initializer=g_kernel,
                               name="g_hidden"),
            keras.layers.Dense(6, kernel_initializer=g_kernel, name="g_out"),
        ], name="generator")
        self.discriminator = keras.Sequential([
            keras.layers.Input((6,)),
            keras.layers.Dense(8, activation="relu", kernel_initializer=d_kernel,
                               name="d_hidden"),
            keras.layers.Dense(1, dtype="float32", name="d_out"),
        ], name="discriminator")
        self.d_tracker = keras.metrics.Mean(name="d_loss")
        self.g_tracker = keras.metrics.Mean(name="g_loss")

    def compile(self, g_opt, d_opt):
        super().compile()
        self.g_opt, self.d_opt = g_opt, d_opt
        self.bce = keras.losses.BinaryCrossentropy(from_logits=True)
        self.g_opt.build(self.generator.trainable_variables)
        self.d_opt.build(self.discriminator.trainable_variables)
        # Tracked as the model's non-trainable variables: fit carries them.
        self.optimizer_state = [*self.g_opt.variables, *self.d_opt.variables]
        # Built on noise (fit would build it on the real samples); a built
        # model takes no new state, so after the list above.
        self.build((None, 4))

    @property
    def metrics(self):
        return [self.d_tracker, self.g_tracker]

    def call(self, noise):
        return self.discriminator(self.generator(noise))

    def _positions(self, variables, within):
        return [next(i for i, w in enumerate(within) if w is v) for v in variables]

    def _values(self, values, variables, within):
        return [values[i] for i in self._positions(variables, within)]

    def _put(self, values, new, variables, within):
        values = list(values)
        for i, value in zip(self._positions(variables, within), new, strict=True):
            values[i] = value
        return values

    def _scaled(self, optimizer, non_trainable, loss):
        positions = self._positions(optimizer.variables, self.non_trainable_variables)
        mapping = [(v, non_trainable[i])
                   for v, i in zip(optimizer.variables, positions, strict=True)]
        with keras.StatelessScope(state_mapping=mapping):
            return optimizer.scale_loss(loss)

    def train_step(self, state, real):
        trainable, non_trainable, optimizer_variables, metrics_variables = state
        all_trainable, all_non_trainable = self.trainable_variables, self.non_trainable_variables
        if isinstance(real, tuple):  # train_on_batch hands (x, y, sample_weight)
            real = real[0]
        batch = real.shape[0]
        # Drawn as Keras draws in a stateless step: the seed's state is in
        # the step's state, and its new value goes back into it.
        with keras.StatelessScope(
                state_mapping=list(zip(all_non_trainable, non_trainable, strict=True))) as scope:
            noise = keras.random.normal((batch, 4), seed=self.seeds)
        non_trainable = self._put(non_trainable, [scope.get_current_value(self.seeds.state)],
                                  [self.seeds.state], all_non_trainable)
        d_weights = self.discriminator.trainable_variables
        g_weights = self.generator.trainable_variables

        def d_loss_fn(d_values, non_trainable):
            fake, _ = self.generator.stateless_call(
                self._values(trainable, g_weights, all_trainable), [], noise)
            logits, _ = self.discriminator.stateless_call(
                d_values, [], keras.ops.concatenate([real, keras.ops.cast(fake, real.dtype)], 0))
            labels = keras.ops.concatenate([keras.ops.ones((batch, 1)),
                                            keras.ops.zeros((batch, 1))], 0)
            loss = self.bce(labels, logits)
            return self._scaled(self.d_opt, non_trainable, loss), loss

        (_, d_loss), d_grads = jax.value_and_grad(d_loss_fn, has_aux=True)(
            self._values(trainable, d_weights, all_trainable), non_trainable)
        d_state = self._values(non_trainable, self.d_opt.variables, all_non_trainable)
        d_applied = d_state[self._positions([self.d_opt.iterations], self.d_opt.variables)[0]]
        if self.nonfinite_d_loss_at is not None:
            d_loss = d_loss + keras.ops.where(d_applied == self.nonfinite_d_loss_at, np.inf, 0.0)
        d_new, d_state = self.d_opt.stateless_apply(
            d_state, d_grads, self._values(trainable, d_weights, all_trainable))
        trainable = self._put(trainable, d_new, d_weights, all_trainable)
        non_trainable = self._put(non_trainable, d_state, self.d_opt.variables,
                                  all_non_trainable)

        def g_loss_fn(g_values, non_trainable):
            fake, _ = self.generator.stateless_call(g_values, [], noise)
            logits, _ = self.discriminator.stateless_call(
                self._values(trainable, d_weights, all_trainable), [], fake)
            loss = self.bce(keras.ops.ones((batch, 1)), logits)
            if self.nonfinite_g_loss_at is not None:
                loss = loss * keras.ops.where(d_applied == self.nonfinite_g_loss_at, np.inf, 1.0)
            return self._scaled(self.g_opt, non_trainable, loss), loss

        (_, g_loss), g_grads = jax.value_and_grad(g_loss_fn, has_aux=True)(
            self._values(trainable, g_weights, all_trainable), non_trainable)
        g_state = self._values(non_trainable, self.g_opt.variables, all_non_trainable)
        g_new, g_state = self.g_opt.stateless_apply(
            g_state, g_grads, self._values(trainable, g_weights, all_trainable))
        trainable = self._put(trainable, g_new, g_weights, all_trainable)
        non_trainable = self._put(non_trainable, g_state, self.g_opt.variables,
                                  all_non_trainable)
        logs, metrics_variables = _stateless_metrics(
            self, metrics_variables, {"d_loss": d_loss, "g_loss": g_loss})
        return logs, (trainable, non_trainable, optimizer_variables, metrics_variables)


def gan_data(samples=16):
    return np.random.default_rng(0).random((samples, 6), dtype=np.float32)
