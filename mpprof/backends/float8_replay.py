"""The delayed scaling of Keras' float8 layers, replayed from what a flush
reads: framework-free, shared by the backends' `Float8State`.

`model.quantize("float8")` makes Dense/EinsumDense layers quantize their
inputs and kernel to float8_e4m3fn and their output gradient to float8_e5m2,
each as `x / scale` clipped to the format's max (keras.quantizers.
quantize_and_dequantize). Each tensor has a `<tensor>_scale` variable and a
`<tensor>_amax_history`; every training step the layer's gradient overwrites
them: the step's amax enters the history, and the scale becomes
`max(history) / format_max` (keras.quantizers.compute_float8_scale; a history
of zeros keeps the scale). The scale a step quantizes with is thus set by the
history up to two steps before it.

At each flush a backend reads every scale and history in one batched read
(`DelayedScalingState._read`), and the steps since the previous read are
replayed with that rule (less those a LossScaleOptimizer skipped: they update
nothing): the history holds each step's amax (index 0 the latest, then
oldest to newest), so the scale each step used, and whether its largest
value clipped (saturated) or was at most half the format's smallest subnormal
(every value quantized to zero: round to nearest even), follow. The replay
must end at the history and scale read, or its counts are NaN. Shares of
individual values are not measured here: in-graph taps of the quantized
tensors are needed for them, and the amax is all Keras keeps.
"""

from __future__ import annotations

import numpy as np

from mpprof.backends.collector import Collector
from mpprof.backends.layer_records import nested_layers
from mpprof.dtypes import FLOAT8_RANGES
from mpprof.records import schema

FORMAT_MAX = {name: r.max for name, r in FLOAT8_RANGES.items()}
FORMAT_MIN_SUBNORMAL = {name: r.smallest_subnormal for name, r in FLOAT8_RANGES.items()}
NO_FLOAT8_LAYERS = {"state": "absent", "reason": "no float8 layers (model.quantize('float8'))"}


def float8_layers(model) -> list:
    """The model's layers (at any depth) that Keras trains in float8."""
    layers = nested_layers(model)
    return [
        layer for layer in layers
        if getattr(layer, "quantization_mode", None) == "float8"
        and hasattr(layer, "inputs_amax_history")
    ]


def float8_variables(layers: list) -> list[tuple]:
    """(scale variable, amax history variable) per layer and tensor, in the
    order of FLOAT8_STATE's cells."""
    return [
        (getattr(layer, f"{tensor}_scale"), getattr(layer, f"{tensor}_amax_history"))
        for layer in layers for tensor in schema.FLOAT8_TENSORS
    ]


def replay(history_before: np.ndarray, scale_before: float, history_now: np.ndarray,
           scale_now: float, steps: int, fmt: str) -> np.ndarray:
    """Replays `steps` training steps of one float8 tensor with Keras' rule.

    Args:
        history_before: the amax history read at the previous flush.
        scale_before: the scale read at the previous flush.
        history_now: the amax history read now.
        scale_now: the scale read now.
        steps: train steps run since the previous flush.
        fmt: the tensor's float8 format (a key of `FORMAT_MAX`).

    Returns:
        The FLOAT8_STATE columns from "steps" on: steps, saturated_steps,
        peak_over_max, underflowed_steps, warmup_steps (all NaN when the
        replay does not end at the history and scale read now).
    """
    length = len(history_now)
    fmax, tiny = FORMAT_MAX[fmt], FORMAT_MIN_SUBNORMAL[fmt]
    chronological_before = np.roll(history_before, -1)
    chronological_now = np.roll(history_now, -1)
    unknown = np.full(5, np.nan)
    if steps > length or steps < 0:
        return unknown
    new = chronological_now[length - steps:] if steps else chronological_now[:0]
    # The history before each new step: a sliding window over the amax of
    # the steps before and the new ones. After each step Keras sets the scale
    # the next step quantizes with from the window before that step's amax
    # (and keeps the scale while the window holds no positive amax).
    sequence = np.concatenate([chronological_before, new])
    window_max = np.lib.stride_tricks.sliding_window_view(sequence, length)[:steps].max(axis=1)
    set_here = (window_max > 0) & np.isfinite(window_max)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        # In float32, as Keras computes it (`1 / (format_max / amax)`): the
        # scale a step used is then the one read, however far apart the
        # flushes are, also for an amax at the very edge of its own scale.
        keras_scale = np.float32(1) / (np.float32(fmax) / window_max.astype(np.float32))
    scale_set = np.where(set_here, keras_scale.astype(np.float64), np.nan)
    # The scale read before was set from the history without its latest
    # entry; the initial scale (history of zeros) is warm-up, not an amax's.
    before_from_amax = bool(np.any(chronological_before[:-1] > 0))
    candidates = np.concatenate([[scale_before], scale_set])
    last_set = np.maximum.accumulate(np.where(~np.isnan(candidates), np.arange(steps + 1), 0))
    scales = candidates[last_set]  # scales[j]: the scale step j (0-based) used; [-1]: now
    from_amax = (last_set > 0) | before_from_amax
    used, amax, real = scales[:-1], new, from_amax[:-1]
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = amax / (used * fmax)
    judged = real & (amax > 0)
    saturated = int(np.sum(judged & (ratio > 1)))
    underflowed = int(np.sum(judged & (amax / used <= tiny / 2)))
    warmup = int(np.sum(~real))
    peak = float(ratio[judged].max()) if judged.any() else np.nan
    expected_now = np.roll(sequence[steps:], 1)
    if not (np.allclose(expected_now, history_now, rtol=1e-6, atol=0)
            and np.isclose(scales[-1], scale_now, rtol=1e-5)):
        return unknown
    return np.array([steps, saturated, peak, underflowed, warmup], dtype=np.float64)


class DelayedScalingState(Collector):
    """Records the float8 layers' scales and amax histories at each flush,
    with the steps between two flushes replayed (`replay`). A backend's
    `Float8State` reads the variables (`_read`) and starts the series
    (`_start`, from its `install`).

    Args:
        model: the model being fit.
        loss_scales: the fit's `LossScales`: a step a LossScaleOptimizer
            skipped (non-finite gradients) leaves the float8 state untouched,
            so the replay covers only the steps whose update ran.
    """

    name = "float8"

    def __init__(self, model, loss_scales):
        self._layers = float8_layers(model)
        self._loss_scales = loss_scales
        self._variables = float8_variables(self._layers)
        self._replica_count = 1
        self._previous: list[tuple[float, np.ndarray]] | None = None
        self._previous_step = 0
        self._previous_skipped = 0
        self._layout_written = False

    def _read(self) -> list[tuple[float, np.ndarray]] | None:
        """(scale, amax history) per layer and tensor, in `_variables`' order;
        None where the backend cannot read them now."""
        raise NotImplementedError

    def _write_replicas(self, fit) -> None:
        """Writes what each replica holds (where there are several)."""

    def _start(self, fit) -> None:
        """What the first flush replays from: the variables as the fit starts."""
        self._previous = self._read()
        self._previous_step = fit.step
        self._previous_skipped = self._skipped()

    def _skipped(self) -> int:
        """Steps the LossScaleOptimizers skipped so far (0 without one)."""
        return self._loss_scales.skipped_steps() if self._loss_scales else 0

    def flush(self, fit) -> None:
        if not self._layers or self._previous is None:
            return
        steps = fit.step - self._previous_step
        if not steps and self._layout_written:
            return  # flushed already at this step: nothing new to replay
        now = self._read()
        if now is None:
            return  # the next flush replays these steps too
        skipped = self._skipped()
        updates = steps - (skipped - self._previous_skipped)
        tensors = len(schema.FLOAT8_TENSORS)
        rows = np.zeros((len(self._layers), tensors, len(schema.FLOAT8_STATE_COLUMNS)))
        for index, ((scale, history), (scale_before, history_before)) in enumerate(
            zip(now, self._previous, strict=True)
        ):
            tensor = schema.FLOAT8_TENSORS[index % tensors]
            replayed = replay(history_before, scale_before, history, scale, updates,
                              schema.FLOAT8_FORMATS[tensor])
            amax_max = float(history.max()) if len(history) else 0.0
            amax_last = float(history[0]) if len(history) else 0.0
            rows[index // tensors, index % tensors] = [scale, amax_max, amax_last, *replayed]
        if not self._layout_written:
            fit.writer.write_json(schema.FLOAT8_LAYOUT, self.layout(), fit.step)
            self._layout_written = True
        fit.writer.write_array(schema.FLOAT8_STATE, rows, fit.step)
        self._write_replicas(fit)
        self._previous, self._previous_step = now, fit.step
        self._previous_skipped = skipped

    def layout(self) -> dict:
        """The FLOAT8_LAYOUT record."""
        formats = dict(schema.FLOAT8_FORMATS)
        return {
            "layers": [
                {
                    "name": getattr(layer, "path", None) or layer.name,
                    "policy": layer.dtype_policy.name,
                    "amax_history_length": int(layer.inputs_amax_history.shape[0]),
                }
                for layer in self._layers
            ],
            "tensors": list(schema.FLOAT8_TENSORS),
            "formats": formats,
            "format_max": {f: FORMAT_MAX[f] for f in set(formats.values())},
            "format_min_subnormal": {f: FORMAT_MIN_SUBNORMAL[f] for f in set(formats.values())},
            "replicas": self._replica_count,
            "amax_across_replicas": self.amax_across_replicas(),
        }

    def amax_across_replicas(self) -> str | None:
        """How the replicas' amax histories relate (None with one replica)."""
        return None

    def context(self) -> dict:
        if not self._layers:
            return dict(NO_FLOAT8_LAYERS)
        if self._replica_count > 1:
            return {"state": "ok", "replicas": self._replica_count,
                    "amax_across_replicas": self.amax_across_replicas()}
        return {"state": "ok"}
