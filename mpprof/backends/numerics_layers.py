"""Which layers and variables every backend's numerics taps measure, and the
layout record that names a sample's rows (framework-free, shared so that the
NUMERICS_LAYOUT record reads the same on every backend).

Every leaf layer is measured; a recurrent layer (GRU, LSTM, any `RNN`) at its
boundary, as if it were a leaf, and the layers inside it are listed as
skipped with the reason and the layer measured for them (its cell runs in a
loop: a `tf.while_loop`, a `lax.scan`, a Python loop, or a fused kernel). A
backend skips more layers as the step tells it (one called inside control
flow, one called more than `MAX_CALLS` times). The variables measured are
the trainable ones that receive a gradient.
"""

from __future__ import annotations

from mpprof.backends.layer_records import child_layers, variable_path, walk_layers
from mpprof.backends.numerics_rows import ESTIMATED_COLUMNS, SAMPLE_VALUES
from mpprof.records import schema

# Calls of one layer in one step that are measured (a shared layer), on the
# backends that keep each call's rows apart (JAX, PyTorch).
MAX_CALLS = 4
# The reason of a layer measured on its first calls only: still measured.
_TOO_MANY_CALLS = (f"called more than {MAX_CALLS} times in a step: "
                   f"its first {MAX_CALLS} calls are measured")


def is_recurrent(layer) -> bool:
    """Whether `layer` is a Keras 3 or tf-keras `RNN` (GRU, LSTM, ConvLSTM...)."""
    return any(cls.__name__ == "RNN" for cls in type(layer).__mro__)


class LayerRows:
    """The rows of a model's numerics: its layers (`walk_layers` order) and
    its measured variables, which of them are measured, which are skipped
    and why, and the order the step called them in.

    A subclass (each backend's `NumericsTaps`) appends a row to
    `_call_order` when a measured layer is called in the sampled step, and
    notes a layer it cannot measure in `_skipped` (row -> reason) and, where
    an enclosing layer stands for it, `_measured_at` (row -> that row).

    Args:
        model: the built model.
        recurrent_loop: how a recurrent layer runs its cell on this backend
            (the skipped layers' reason names it).
    """

    # The layout's "aggregation": how a backend adds up a layer's calls in
    # a sample.
    aggregation: str

    def __init__(self, model, recurrent_loop: str):
        entries = walk_layers(model)
        self.layer_names = [name for name, _, _ in entries]
        self._rows = {id(layer): row for row, (_, layer, _) in enumerate(entries)}
        row_of_name = {name: row for row, (name, _, _) in enumerate(entries)}
        self._parent_rows = {row: row_of_name[parent]
                             for row, (_, _, parent) in enumerate(entries) if parent is not None}
        self._call_order: list[int] = []
        # Rows whose call could not be measured: row -> reason.
        self._skipped: dict[int, str] = {}
        # Skipped row -> the row measured at its boundary instead.
        self._measured_at: dict[int, int] = {}
        # Rows measured whenever called: leaves, and recurrent layers in
        # place of everything inside them.
        self._measured_rows: set[int] = set()
        for row, (_, layer, _) in enumerate(entries):
            recurrent = self._outermost_recurrent(row, entries)
            if recurrent is not None:
                self._skipped[row] = (f"runs inside the recurrent layer "
                                      f"{entries[recurrent][0]!r} ({recurrent_loop})")
                self._measured_at[row] = recurrent
            elif is_recurrent(layer) or not child_layers(layer):
                self._measured_rows.add(row)
        # A float8 layer's scales and amax histories are trainable, but what
        # the step "differentiates" into them is their next value (Keras
        # overwrites them with it): not a gradient, so not measured as one.
        self._variables = [v for v in model.trainable_variables
                           if not getattr(v, "overwrite_with_gradient", False)]
        self.variable_names = [variable_path(v) for v in self._variables]

    def _outermost_recurrent(self, row: int, entries) -> int | None:
        """The outermost recurrent layer `row` runs inside (None: none): its
        loop holds every layer below it."""
        found = None
        parent = self._parent_rows.get(row)
        while parent is not None:
            if is_recurrent(entries[parent][1]):
                found = parent
            parent = self._parent_rows.get(parent)
        return found

    def _count_call(self, calls: dict[int, int], row: int) -> int | None:
        """This call's index among the layer's calls in the step (counted in
        `calls`), or None past `MAX_CALLS` (then noted as skipped)."""
        call = calls.get(row, 0)
        calls[row] = call + 1
        if call >= MAX_CALLS:
            self._skipped.setdefault(row, _TOO_MANY_CALLS)
            return None
        return call

    @property
    def call_order(self) -> list[int]:
        """Rows of the measured layers: in the order the sampled step called
        them, then leaves it never called (zeros).

        A layer skipped at one call site is left out even where another call
        was measured (an RNN calls its cell once before the loop to learn the
        output's shape, and that call alone is not the cell's numerics); one
        measured on its first `MAX_CALLS` calls only stays.
        """
        seen = [row for row in dict.fromkeys(self._call_order)
                if self._skipped.get(row, _TOO_MANY_CALLS) == _TOO_MANY_CALLS]
        unseen = sorted(self._measured_rows - set(self._call_order) - set(self._skipped))
        return seen + unseen

    def layout(self, policy_max: float) -> dict:
        """The JSON record naming the rows of every sample.

        "estimated" says which statistics of a large tensor come from a sample
        of its values (`mpprof.backends.numerics_rows`).

        "skipped" lists the layers left unmeasured: {"layer", "reason",
        "measured_at"} (the enclosing layer measured instead, or None).
        """
        return {
            "layers": [self.layer_names[row] for row in self.call_order],
            "variables": self.variable_names,
            "hist_edges": schema.NUMERICS_HIST_EDGES,
            "policy_max": policy_max,
            "aggregation": self.aggregation,
            "estimated": {
                "columns": list(ESTIMATED_COLUMNS),
                "histograms": True,
                "sample_values": SAMPLE_VALUES,
                "how": ("a tensor of more than sample_values values is cut into that many "
                        "equal strata and one value at a fixed jitter in each stands for "
                        "its stratum; count, nonfinite and abs_max are exact"),
            },
            "skipped": [
                {"layer": self.layer_names[row], "reason": reason,
                 "measured_at": (self.layer_names[self._measured_at[row]]
                                 if row in self._measured_at else None)}
                for row, reason in self._skipped.items()
            ],
        }
