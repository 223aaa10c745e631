"""A verification candidate applied to a Keras model, alike on every backend.

`mpprof.replay.verification` judges a candidate (a policy map, inputs scaled
into range) by passes and a short trial that each backend's replay engine
runs its own way; what those have in common is here: setting the candidate's
policies for the length of a pass and putting back what was there, scaling
the inputs, the trial's fresh optimizer, the trial itself and the engine's bookkeeping
(`CandidateEngine`, which each backend completes with `run_pass` and
`trial_step`; `EagerEngine`, the eager passes of TensorFlow and PyTorch).
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Callable, Iterator, Mapping

import keras
import numpy as np

from mpprof.backends import keras_capture
from mpprof.backends.layer_records import called_method, walk_layers
from mpprof.backends.patching import Patches
from mpprof.replay import files, verification
from mpprof.replay.files import ReplayError
from mpprof.replay.search import PassResult
from mpprof.replay.verification import Candidate


def layer_tree(model) -> dict[str, object]:
    """Qualified name -> layer, for every nested layer."""
    return {name: layer for name, layer, _ in walk_layers(model)}


def _policy_of(layer) -> tuple:
    """What setting `layer.dtype_policy` changes, to put back after a pass.

    A layer built with a `DTypePolicyMap` keeps the map: setting its policy
    adds an entry for its path to the (shared) map, and setting the map back
    would make the map an entry of itself. So for such a layer the entry is
    what is kept: (map, whether it had one, the entry)."""
    policy = layer.dtype_policy
    path = getattr(layer, "path", None)
    if isinstance(policy, keras.dtype_policies.DTypePolicyMap) and path:
        return policy, path in policy, policy[path] if path in policy else None
    return policy, None, None


def _restore_policy(layer, saved: tuple) -> None:
    policy, had_entry, entry = saved
    path = getattr(layer, "path", None)
    if isinstance(policy, keras.dtype_policies.DTypePolicyMap) and path:
        if path in policy:
            del policy[path]
        if had_entry:
            policy[path] = entry
        return
    layer.dtype_policy = policy


@contextlib.contextmanager
def policies_applied(model, tree: Mapping[str, object], policies: Mapping[str, str],
                     model_policy: str | None = None) -> Iterator[None]:
    """Each named layer computes with its policy (and the model with
    `model_policy`, when given) inside the block; what was there is put back
    after it, also when it raises."""
    changed = {name: policy for name, policy in policies.items()
               if tree[name].dtype_policy.name != policy}
    saved = {name: _policy_of(tree[name]) for name in changed}
    saved_model = _policy_of(model)
    try:
        for name, policy in changed.items():
            tree[name].dtype_policy = policy
        if model_policy is not None:
            model.dtype_policy = model_policy
        yield
    finally:
        for name, policy in saved.items():
            _restore_policy(tree[name], policy)
        _restore_policy(model, saved_model)


def scale_inputs(data, scale: float | None):
    """The batch with its inputs (`x`: the first element of an (x, y, ...)
    tuple, or the whole batch otherwise) multiplied by `scale` in float32, as
    a float32 `Rescaling(scale)` first layer or the division in the input
    pipeline computes them; numeric leaves only."""
    if scale is None:
        return data

    def scaled(leaf):
        if isinstance(leaf, np.ndarray) and np.issubdtype(leaf.dtype, np.number) \
                and not np.issubdtype(leaf.dtype, np.bool_):
            return leaf.astype(np.float32) * np.float32(scale)
        return leaf

    if isinstance(data, tuple) and data:
        return (keras.tree.map_structure(scaled, data[0]), *data[1:])
    return keras.tree.map_structure(scaled, data)


def trial_optimizer(model, dtype: str, loss_scale: float, run_scaled: bool = False):
    """A fresh optimizer of the run's config for a trial computing in
    `dtype`: wrapped in a LossScaleOptimizer (initial scale `loss_scale`)
    for float16 where the run's was one (`model.optimizer` is, or
    `run_scaled`: the run had a loss scale, which a model rebuilt from its
    config loses, being compiled before its policy is set), or where the run
    computed in no float16 at all (as `model.compile` wraps it under
    mixed_float16); the inner optimizer alone otherwise.

    Raises:
        ReplayError: the model has no optimizer (it was not compiled).
    """
    run = getattr(model, "optimizer", None)
    if run is None:
        raise ReplayError("the model has no optimizer (it was not compiled, and the "
                          "capture's config holds no compile config)")
    wrapped = isinstance(run, keras.optimizers.LossScaleOptimizer)
    inner = run.inner_optimizer if wrapped else run
    fresh = type(inner).from_config(inner.get_config())
    run_half = {verification.policy_compute_dtype(layer.dtype_policy.name)
                for layer in layer_tree(model).values()}
    if dtype == "float16" and (wrapped or run_scaled or "float16" not in run_half):
        return keras.optimizers.LossScaleOptimizer(fresh, initial_scale=loss_scale)
    return fresh


# The first seed the trial's and the passes' random layers draw from: any
# fixed value makes a verdict repeatable (a rebuilt model's SeedGenerators
# start from a new random seed in each process unless the user seeded Keras).
REPLAY_SEED = 1337


@contextlib.contextmanager
def repeatable_random_draws(tree: Mapping[str, object]) -> Iterator[list[str]]:
    """Inside the block, every SeedGenerator of the model starts from a fixed
    seed (`REPLAY_SEED`, one per generator), so float32's and a candidate's
    passes and trials see the same dropout masks in every process: the same
    capture gets the same verdict twice, and a comparison measures the
    precision, not the masks. The generators' states are put back after.

    Each weightless layer that draws random numbers (Dropout, GaussianNoise,
    random augmentation) also computes in float32 and casts its output back:
    stateless random ops draw in the tensor's dtype, so from the same seed
    float16 and float32 draw different masks. Yields those layers' names."""
    patches = Patches()
    # Weightless ones only: a layer with weights and a seed (an LSTM cell's
    # dropout) computes its state in its own dtype and cannot be cast whole.
    names = [name for name, layer in tree.items()
             if getattr(layer, "_seed_generators", None) and not layer.weights]
    generators = list({id(generator): generator for layer in tree.values()
                       for generator in getattr(layer, "_seed_generators", ())}.values())
    saved = [keras.ops.convert_to_numpy(generator.state.value) for generator in generators]
    try:
        for index, generator in enumerate(generators):
            generator.state.assign(np.array([REPLAY_SEED + index, 0], dtype=saved[index].dtype))
        for name in names:
            layer = tree[name]
            method = called_method(layer)
            patches.set(layer, method, _in_float32(getattr(layer, method)))
        yield names
    finally:
        patches.restore()
        for generator, state in zip(generators, saved, strict=True):
            generator.state.assign(state)


def _is_float_tensor(value) -> bool:
    dtype = getattr(value, "dtype", None)
    return dtype is not None and "float" in str(dtype) and keras.ops.is_tensor(value)


def _in_float32(call):
    def call_in_float32(inputs, *args, **kwargs):
        dtype = next((t.dtype for t in keras.tree.flatten(inputs) if _is_float_tensor(t)),
                     None)
        if dtype is None:
            return call(inputs, *args, **kwargs)
        outputs = call(keras.tree.map_structure(
            lambda t: keras.ops.cast(t, "float32") if _is_float_tensor(t) else t, inputs),
            *args, **kwargs)
        return keras.tree.map_structure(
            lambda t: keras.ops.cast(t, dtype) if _is_float_tensor(t) else t, outputs)

    return call_in_float32


class CandidateEngine(abc.ABC):
    """`mpprof.replay.verification.Engine` for a Keras model, the part every
    backend shares: the candidate's policies, its scaled inputs, the trial
    (`train`: a fresh optimizer swapped in, the policies applied, repeatable
    random draws, steps the loss scale skips retried) and the captured state
    put back after. A backend completes it with two framework methods:

    - `run_pass(candidate, batch, loss_scale)`: one watched forward and
      backward pass (`verification.Engine.run_pass`); `self.policies`,
      `self.pass_data` and `repeatable_random_draws` give it the candidate's
      policies and batch.
    - `trial_step(optimizer)`: called once per trial, inside its context (the
      candidate's policies set, `optimizer` as `model.optimizer`, built):
      returns `step(batch) -> float | None`, which applies one update of the
      model's own `train_step` (compiled anew: traced with these policies and
      this optimizer) and returns its loss (`trial_loss` of its logs), or None
      where the loss scale skipped it.

    Args:
        model: the model, its captured weights loaded.
        batches: the captured batches, as the step receives them.
        loss_scale: the run's loss scale at the capture (1.0: none).

    Example:
        class Engine(CandidateEngine):
            def run_pass(self, candidate, batch, loss_scale): ...
            def trial_step(self, optimizer): ...

        verification.Verifier(Engine(model, batches, 2.0**15)).verify(candidate)
    """

    # A model whose own train_step uses optimizers of its own (a GAN's,
    # `model.optimizer` unset): the trial runs them from their captured state.
    uses_own_optimizers = False

    def __init__(self, model, batches: list, loss_scale: float):
        self.model = model
        self.batches = batches
        self.batch_count = len(batches)
        self.loss_scale = float(loss_scale)
        self.tree = layer_tree(model)
        self.run_policies: Mapping[str, str] = {name: layer.dtype_policy.name
                             for name, layer in self.tree.items()}
        self.skipped_steps = 0  # by the loss scale, in the last trial
        # The captured state every trial starts from, and that it leaves:
        # weights, moving statistics and random seed states.
        self._variables = [*model.trainable_variables, *model.non_trainable_variables]
        self._initial = [np.array(keras.ops.convert_to_numpy(v)) for v in self._variables]

    @abc.abstractmethod
    def run_pass(self, candidate: Candidate, batch: int, loss_scale: float) -> PassResult:
        """`verification.Engine.run_pass`, the framework's way."""

    @abc.abstractmethod
    def trial_step(self, optimizer) -> Callable[[object], float | None]:
        """The trial's update function (see the class docstring); `optimizer`
        is None for a model with optimizers of its own."""

    def policies(self, candidate: Candidate) -> dict[str, str]:
        return verification.effective_policies(candidate, self.run_policies)

    def pass_data(self, candidate: Candidate, batch: int):
        """Captured batch `batch` with the candidate's input change."""
        return scale_inputs(self.batches[batch], candidate.input_scale)

    def trial_optimizer(self, candidate: Candidate, loss_scale: float | None = None):
        """A fresh optimizer of the run's config for the candidate's trial
        (`trial_optimizer`), a LossScaleOptimizer's initial scale
        `loss_scale` (None: the run's, or Keras' default without one). None
        for a model with optimizers of its own (`uses_own_optimizers`)."""
        if getattr(self.model, "optimizer", None) is None and self.uses_own_optimizers:
            return None
        dtype = verification.candidate_dtype(candidate, self.run_policies)
        if loss_scale is None:
            loss_scale = (self.loss_scale if self.loss_scale > 1
                          else verification.DEFAULT_LOSS_SCALE)
        return trial_optimizer(self.model, dtype, loss_scale, run_scaled=self.loss_scale > 1)

    def train(self, candidate: Candidate, steps: int,
              loss_scale: float | None = None) -> list[float]:
        """`verification.Engine.train`: `steps` updates from the captured
        state, through `trial_step`; the model is left as it was."""
        model = self.model
        optimizer = self.trial_optimizer(candidate, loss_scale)
        batches = [scale_inputs(b, candidate.input_scale) for b in self.batches]
        losses: list[float] = []
        calls = 0
        with self.swapped_optimizer(optimizer), policies_applied(
                model, self.tree, self.policies(candidate), candidate.default_policy), \
                repeatable_random_draws(self.tree):
            if optimizer is not None:
                optimizer.build(model.trainable_variables)
            step = self.trial_step(optimizer)
            while len(losses) < steps and calls < steps + verification.TRIAL_MAX_SKIPS:
                loss = step(batches[calls % len(batches)])
                calls += 1
                if loss is not None:
                    losses.append(loss)
        self.skipped_steps = calls - len(losses)
        return losses

    def restore(self) -> None:
        """The captured state back in the model's variables."""
        for variable, value in zip(self._variables, self._initial, strict=True):
            variable.assign(value)

    @contextlib.contextmanager
    def swapped_optimizer(self, optimizer) -> Iterator[None]:
        """`model.optimizer` is `optimizer` inside the block (the step uses
        it); the run's is put back after, and the captured state, and the
        metrics are reset."""
        model = self.model
        saved = model.optimizer
        if optimizer is not None:
            model.optimizer = optimizer
        try:
            yield
        finally:
            model.optimizer = saved
            self.restore()
            for metric in model.metrics:
                metric.reset_state()


class EagerEngine(CandidateEngine):
    """A `CandidateEngine` whose passes run the step eagerly, op by op, as
    `model(x, training=True)` and `model.compute_loss` (TensorFlow, PyTorch):
    a subclass names its framework's pass, `pass_function(model, batch,
    loss_scale, float32_layers, *, all_float32=False, policies=None,
    model_policy=None)` (its `replay_passes.run_pass`), and `trial_step`.
    """

    pass_function: Callable[..., PassResult]

    @classmethod
    def for_batches(cls, model, batches: list, loss_scale: float = 1.0) -> EagerEngine:
        """A verification engine (`mpprof.replay.verification.Engine`) of
        `model` as it is now (its weights are the ones every pass and trial
        start from) on `batches` (each as `train_step` receives it: (x, y)
        or (x, y, sample_weight))."""
        return cls(model, [keras.utils.unpack_x_y_sample_weight(b) for b in batches],
                   loss_scale)

    @classmethod
    def replay_result(cls, model, capture: files.Capture, *, backend: str,
                      unrunnable: str = "", **extra) -> dict:
        """The replay of `capture` (its weights already in `model`): its
        batch's passes with the run's policies and all in float32, and
        `keras_capture.replay_result` of them; `unrunnable` ends the error of
        a step that cannot run eagerly, `extra` are the engine's own keys."""
        batch = keras.utils.unpack_x_y_sample_weight(capture.batch())
        scale = float(capture.manifest.get("loss_scale") or 1.0)
        run_pass = cls.pass_function
        try:
            run_policy = run_pass(model, batch, scale, None)
        except Exception as e:
            raise ReplayError(
                f"the step could not be run eagerly as model(x, training=True) and "
                f"model.compute_loss ({type(e).__name__}: {str(e)[:300]}){unrunnable}") from e
        return keras_capture.replay_result(
            model, capture, scale=scale, run_policy=run_policy,
            reference=run_pass(model, batch, scale, None, all_float32=True),
            engine=cls(model, [batch], scale),
            run_unscaled=lambda float32_layers: run_pass(model, batch, 1.0, float32_layers),
            inputs=keras.tree.flatten(batch[0]), backend=backend, **extra)

    def run_pass(self, candidate: Candidate, batch: int, loss_scale: float) -> PassResult:
        with repeatable_random_draws(self.tree):
            return self.pass_function(self.model, self.pass_data(candidate, batch),
                                      loss_scale, None, policies=self.policies(candidate),
                                      model_policy=candidate.default_policy)


def counted_trial_step(model, optimizer, train_step: Callable[[object], dict]
                       ) -> Callable[[object], float | None]:
    """`CandidateEngine.trial_step`'s update for a backend whose train step
    updates the variables in place (TensorFlow, PyTorch): `train_step(batch)`
    (the model's own, run as the backend's fit runs it) after a reset of the
    metrics; its loss, or None where the loss scale skipped it (a skipped
    step leaves `optimizer.iterations` as it was)."""

    def step(batch) -> float | None:
        for metric in model.metrics:
            metric.reset_state()
        before = int(optimizer.iterations.value)
        logs = train_step(batch)
        if int(optimizer.iterations.value) == before:
            return None
        return trial_loss(logs)

    return step


def trial_loss(logs) -> float:
    """The step's loss from its logs (metrics reset before the step): its
    "loss", else the sum of its "..._loss" entries (a custom step's)."""
    if "loss" in logs:
        return float(np.asarray(keras.ops.convert_to_numpy(logs["loss"])))
    parts = [value for key, value in logs.items() if str(key).endswith("_loss")]
    if not parts:
        raise ReplayError(f"the step logs no loss (its logs: {', '.join(map(str, logs))})")
    return float(sum(np.asarray(keras.ops.convert_to_numpy(v)) for v in parts))
