"""Replay captures on JAX: the batch and weights of a sampled step that went wrong.

The files are TensorFlow's (`mpprof.replay.files`; the manifest says
`"backend": "jax"`, which `mpprof replay` reads to pick the JAX engine). How
they are gathered differs: Keras' JAX step donates its state, so nothing the
step received survives it on the device. On a sampled call, before the
instrumented step runs, the train functions hand this collector
(`before_sampled`) the call's batch (not donated), a device copy of mpprof's
small step table (the counters as the step found them) and device copies of
the non-trainable variables (moving statistics change in the forward pass,
also on a skipped step); after it (`after_sampled`), the state the step
returned, which stays valid until fit passes it to the next call (for a
forensic sample of an earlier step's kept batch, `train_functions`, the
batch is that step's, the weights the current ones, and the state and step
table those the undonated evaluation returned). The host
reads the step table once the call is done (the sampled call waits for its
numerics anyway): the step was skipped when its skipped count moved. Only
then does anything reach the host: the batch, the trainable weights the step
returned (a skipped step leaves them unchanged: the ones it ran with) and
the non-trainable ones as the step found them.

Not captured, as on TensorFlow: the loss scale's initial descent (every step
so far skipped, the loss finite). With `steps_per_execution > 1` the state a
call returns is that after its last step while the instrumented step is its
first: captures are off.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mpprof.backends import keras_capture
from mpprof.backends.jax.custom_step import overrides_train_step
from mpprof.backends.jax.step_state import LAST_LOSS, LOSS_ROW
from mpprof.replay import files


class ReplayCapture(keras_capture.SampledStepCapture):
    """Saves up to `budget` steps per fit that overflowed or lost the loss
    (the arguments: `keras_capture.ReplayCaptureBase`'s)."""

    # What the donated sampled step received (copied before it runs), and
    # what it returned, until written (None: no sampled step under way).
    _before: Any = None
    _after: Any = None

    def overrides_train_step(self, model) -> bool:
        return overrides_train_step(model)

    def unavailable_on_backend(self, model) -> str | None:
        spe = int(getattr(model, "steps_per_execution", 1) or 1)
        if spe > 1:
            return (f"steps_per_execution={spe}: on JAX the sampled step is a call's first "
                    "and the state the call returns is its last step's")
        return None

    # Around the sampled step (called by `TrainFunctions.run_instrumented`).

    def before_sampled(self, state, table, data, step: int | None = None) -> None:
        """`step`: the step `data` is the batch of, when the sampled step runs
        on an earlier, overflowed step's batch (a forensic sample; the state
        is then the current one); None: the step the table says."""
        self._after = None
        if not self.wanted() or self._api.step_state is None:
            self._before = None
            return
        # Device copies, made before the step donates what they copy. A
        # custom step's trainable weights too: its skips are its own
        # optimizers' (a GAN's), which the step table may not see, so the
        # weights it returns may be updated ones.
        trainable = ([jnp.array(v, copy=True) for v in state[0]]
                     if self._custom_step else None)
        self._before = (jnp.array(table, copy=True),
                        [jnp.array(v, copy=True) for v in state[1]], data, trainable, step)

    def after_sampled(self, state, table=None) -> None:
        """`table`: the step table the sampled step returned, when it is not
        the one the call leaves (a forensic sample of an earlier step)."""
        if self._before is not None:
            self._after = (state, table)

    # The core's hook.

    def after_sample(self, fit) -> None:
        """Writes a capture when the sampled step just run went wrong."""
        before, after, self._before, self._after = self._before, self._after, None, None
        if before is None or after is None:
            return
        table_before, non_trainable_before, data, trainable_before, step = before
        after, table_after = after
        table_before = np.asarray(jax.device_get(table_before))
        state = self._api.step_state
        table_after = state.read() if table_after is None else np.asarray(
            jax.device_get(table_after))
        skipped = state.all_skipped(table_after) - state.all_skipped(table_before)
        watched = self._health.watched() is not None if fit.guard.ok(self._health.name) \
            else False
        loss = float(table_after[LOSS_ROW, LAST_LOSS]) if watched else math.nan
        loss_finite = math.isfinite(loss) if watched else None
        applied_before, skipped_before, scale = state.primary_in(table_before)
        if step is None:
            step = applied_before + skipped_before
        decided = self.decide(step, skipped, loss_finite, applied_before)
        if decided is None:
            return
        reasons, folder, captured = decided
        if trainable_before is not None:
            after = (trainable_before, *after[1:])
        self._write(fit, step, data, after, non_trainable_before, reasons, skipped > 0,
                    loss, scale, trainable_before is not None, folder=folder,
                    captured=captured)

    def _write(self, fit, step: int, data, state, non_trainable_before, reasons: list[str],
               skipped: bool, loss: float, scale: float, weights_before: bool,
               folder: str = files.REPLAY_FOLDER, captured: list | None = None) -> None:
        model = fit.model
        leaves: list = []
        structure = files.encode_structure(data, leaves)
        batch = [process_rows(a) for a in leaves]
        global_rows = int(leaves[0].shape[0]) if leaves and np.ndim(leaves[0]) else None
        shard = ({"process": jax.process_index(), "processes": jax.process_count(),
                  "rows": int(batch[0].shape[0]), "global_rows": global_rows}
                 if global_rows is not None and batch[0].shape[0] != global_rows else None)
        values = {id(v): a for v, a in zip(model.trainable_variables, state[0], strict=False)}
        values.update({id(v): a for v, a in zip(model.non_trainable_variables,
                                                non_trainable_before, strict=False)})
        weights = [np.asarray(a) for a in jax.device_get(
            [values[id(v)] if id(v) in values else v.value for v in model.weights])]
        keras_capture.write_capture(
            fit, self.captured if captured is None else captured, step=step, batch=batch,
            weights=weights, reasons=reasons,
            loss=loss, loss_scale=scale, skipped=skipped, structure=structure,
            config=self._config, backend={"backend": "jax", "jax": jax.__version__},
            weights_before=weights_before, folder=folder, batch_shard=shard,
        )

    def end(self, fit) -> None:
        self._before = self._after = None
        super().end(fit)


def process_rows(array) -> np.ndarray:
    """The values of `array` that this process holds: all of it in one
    process (or when it is replicated), and under a job of several processes
    (`jax.distributed`, a batch sharded across them) this process's own rows,
    in order, each read once. Never a collective: gathering the other
    processes' rows would hang the fit the moment one process stopped
    capturing and another did not."""
    if not isinstance(array, jax.Array) or array.is_fully_addressable \
            or array.is_fully_replicated:
        return np.asarray(jax.device_get(array))
    rows: dict[int, np.ndarray] = {}
    for shard in array.addressable_shards:
        start = shard.index[0].start if shard.index else None
        rows.setdefault(start or 0, np.asarray(shard.data))
    return np.concatenate([rows[start] for start in sorted(rows)])
