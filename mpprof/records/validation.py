"""Checks each record read from a logdir against `mpprof.records.schema`.

The reader calls `problem(record, value)` on every record it reads and skips
the ones that fail, so everything downstream (diagnosis, CLI, HTML report,
dashboard) can rely on the shapes and types the schema promises: a file
written by a buggy or hostile writer, or damaged in a way its checksums did
not catch, costs a warning, never a crash or a wrong finding.

Only what mpprof's readers rely on is checked; keys a reader does not use
may hold anything, and keys that older versions did not write may be absent.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from mpprof.records import schema
from mpprof.records.run_context import FIT_STATES

# Steps are stored as float64 columns: beyond 2**53 they are no longer exact
# integers, and no run takes that many steps.
MAX_STEP = 2**53


Check = Callable[[object], str | None]


def problem(record: str, value) -> str | None:
    """Why `value` is not a valid `record` (a name from `schema.RECORDS`), or None."""
    check = _JSON_RECORDS.get(record)
    if check is not None:
        if not isinstance(value, dict):
            return f"is a JSON {type(value).__name__}, not an object"
        return check(value)
    if not isinstance(value, np.ndarray) or value.dtype.kind not in "fiu":
        return "is not a numeric array"
    columns, check_rows = _ARRAY_RECORDS[record]
    if value.ndim not in (1, 2, 3) or value.shape[-1] != (columns or value.shape[-1]):
        return f"has shape {list(value.shape)}; expected rows of {columns} columns"
    return check_rows(value.reshape(-1, value.shape[-1]).astype(np.float64, copy=False))


def step_problem(step: int, wall_time: float) -> str | None:
    """Why an event's own step and wall time cannot be believed, or None."""
    if not 0 <= step < MAX_STEP:
        return f"has step {step}"
    if not math.isfinite(wall_time):
        return f"has wall time {wall_time}"
    return None


# ------------------------------------------------------------ JSON records


def _typed(**fields: Check) -> Check:
    """A check of a JSON object whose present keys must pass their checks."""

    def check(value: dict) -> str | None:
        for key, field_check in fields.items():
            if key in value:
                found = field_check(value[key])
                if found is not None:
                    return f"{key!r} {found}"
        return None

    return check


def _required(*keys: str, then: Check) -> Check:
    def check(value: dict) -> str | None:
        missing = [key for key in keys if key not in value]
        if missing:
            return f"lacks {', '.join(map(repr, missing))}"
        return then(value)

    return check


def _is(*types: type, optional: bool = True) -> Check:
    """Of one of `types` (None too if `optional`); bool is not a number."""
    names = " or ".join(t.__name__ for t in types)

    def check(value) -> str | None:
        if value is None and optional:
            return None
        if isinstance(value, bool) and bool not in types:
            return f"is a bool, not {names}"
        if not isinstance(value, types):
            return f"is {type(value).__name__}, not {names}"
        return None

    return check


def _list_of(item: Check) -> Check:
    def check(value) -> str | None:
        if value is None:
            return None
        if not isinstance(value, list):
            return f"is {type(value).__name__}, not a list"
        for index, element in enumerate(value):
            found = item(element)
            if found is not None:
                return f"item {index} {found}"
        return None

    return check


def _dict_of(item: Check) -> Check:
    def check(value) -> str | None:
        if value is None:
            return None
        if not isinstance(value, dict):
            return f"is {type(value).__name__}, not an object"
        for key, element in value.items():
            found = item(element)
            if found is not None:
                return f"entry {key!r} {found}"
        return None

    return check


def _object(**fields: Check) -> Check:
    inner = _typed(**fields)

    def check(value) -> str | None:
        if value is None:
            return None
        if not isinstance(value, dict):
            return f"is {type(value).__name__}, not an object"
        return inner(value)

    return check


def _one_of(*allowed) -> Check:
    def check(value) -> str | None:
        return None if value in allowed else f"is {value!r}, not one of {list(allowed)}"

    return check


def _count(value) -> str | None:
    """A non-negative integer (or None)."""
    found = _is(int)(value)
    if found is None and value is not None and not 0 <= value < MAX_STEP:
        return f"is {value}, not a count"
    return found


_TEXT = _is(str)
_NUMBER = _is(int, float)
_FLAG = _is(bool)
_TEXTS = _list_of(_is(str, optional=False))
_INTS = _list_of(_is(int, optional=False))
_OBJECTS = _list_of(_object())

_COLLECTOR = _object(state=_TEXT, reason=_TEXT, mode=_TEXT, devices=_OBJECTS)

_CONTEXT = _typed(
    mpprof_version=_TEXT,
    global_policy=_TEXT,
    model_policy=_TEXT,
    optimizer=_TEXT,
    jit_compile=_FLAG,
    run_eagerly=_FLAG,
    steps_per_execution=_count,
    distribution_strategy=_TEXT,
    num_replicas=_count,
    devices=_OBJECTS,
    framework=_object(name=_TEXT, version=_TEXT, libraries=_object()),
    gpus_visible=_count,
    collectors=_dict_of(_COLLECTOR),
    start_step=_count,
    fit_count=_count,
    wall_time=_NUMBER,
    hardware=_object(gpus=_OBJECTS, cpu_only=_FLAG),
    distributed=_object(),
    run_role=_TEXT,
    worker_evidence=_object(),
    fit_state=_one_of(*FIT_STATES),
    fit_error=_object(type=_TEXT, module=_TEXT, message=_TEXT, step=_count),
)

_LAYER = _required(
    "name",
    "class",
    then=_typed(
        name=_is(str, optional=False),
        **{"class": _is(str, optional=False)},
        is_leaf=_FLAG,
        call_index=_count,
        policy=_TEXT,
        compute_dtype=_TEXT,
        variable_dtype=_TEXT,
        output_dtypes=_TEXTS,
        quantization_mode=_TEXT,
        quantized_formats=_dict_of(_TEXT),
        params=_count,
        gemm_dims=_INTS,
        gemm_flops=_is(int),
        output_shape=_INTS,
        misaligned_dims=_INTS,
        float32_island=_FLAG,
    ),
)

_INVENTORY = _typed(
    model=_object(policy=_TEXT, output_dtypes=_TEXTS, loss_input_dtypes=_TEXTS),
    layers=_list_of(lambda layer: _is(dict, optional=False)(layer) or _LAYER(layer)),
    casts=_OBJECTS,
)


def _layout(value: dict) -> str | None:
    found = _typed(layers=_TEXTS, variables=_TEXTS, hist_edges=_list_of(_NUMBER))(value)
    if found is not None:
        return found
    edges = np.asarray(value["hist_edges"], dtype=np.float64)
    if not len(edges) or not np.all(np.isfinite(edges)) or np.any(np.diff(edges) <= 0):
        return "'hist_edges' is not an increasing list of finite numbers"
    policy_max = value["policy_max"]
    if _NUMBER(policy_max) is not None or policy_max is None or not (
        math.isfinite(policy_max) and policy_max > 0
    ):
        return f"'policy_max' is {policy_max!r}, not the dtype's largest finite value"
    return None


_HEALTH = _typed(
    first_nonfinite_loss_step=_count,
    first_nonfinite_loss_step_last=_count,
    first_nonfinite_loss_count=_count,
    nonfinite_loss_steps=_count,
    nonfinite_weights=_TEXTS,
    checked_step=_count,
    loss_guarded_by=_TEXTS,
)

_KERNEL_STATS = _typed(
    source=_TEXT,
    tensor_core_share=lambda v: _NUMBER(v) or (
        None if v is None or 0 <= v <= 1 else f"is {v}, not a share in [0, 1]"
    ),
    total_gpu_kernel_us=_NUMBER,
    tensor_core_us=_NUMBER,
    eligible_not_using_us=_NUMBER,
    no_gpu_kernels=_FLAG,
    top_ops=_OBJECTS,
)

_FLOAT8_LAYER = _required(
    "name",
    then=_typed(name=_is(str, optional=False), policy=_TEXT, amax_history_length=_count),
)

_FLOAT8_LAYOUT = _typed(
    layers=_list_of(lambda layer: _is(dict, optional=False)(layer) or _FLOAT8_LAYER(layer)),
    tensors=_TEXTS,
    formats=_dict_of(_TEXT),
    format_max=_dict_of(_NUMBER),
    format_min_subnormal=_dict_of(_NUMBER),
    replicas=_count,
    amax_across_replicas=_TEXT,
)

_JSON_RECORDS: dict[str, Check] = {
    schema.RUN_CONTEXT: _CONTEXT,
    schema.INVENTORY: _INVENTORY,
    schema.NUMERICS_LAYOUT: _required(
        "layers", "variables", "hist_edges", "policy_max", then=_layout
    ),
    schema.HEALTH: _HEALTH,
    schema.KERNEL_STATS: _KERNEL_STATS,
    schema.FLOAT8_LAYOUT: _required("layers", "tensors", then=_FLOAT8_LAYOUT),
}


# ----------------------------------------------------------- array records


def _steps(column: np.ndarray, name: str) -> str | None:
    with np.errstate(invalid="ignore"):  # inf % 1 is NaN: not a step either
        bad = ~(np.isfinite(column) & (column >= 0) & (column < MAX_STEP) & (column % 1 == 0))
    if bad.any():
        return f"has {name} {column[bad][0]!r}"
    return None


def _scales(column: np.ndarray) -> str | None:
    bad = np.isnan(column) | (column < 0)
    return f"has loss scale {column[bad][0]!r}" if bad.any() else None


def _counts(rows: np.ndarray) -> str | None:
    bad = ~(np.isfinite(rows) & (rows >= 0))
    return f"has count {rows[bad][0]!r}" if bad.any() else None


def _first(*checks) -> str | None:
    return next((found for found in checks if found is not None), None)


def _loss_scale_events(rows: np.ndarray) -> str | None:
    column = schema.LOSS_SCALE_EVENT_COLUMN
    kinds = rows[:, column.kind]
    bad_kind = ~np.isin(kinds, (schema.EVENT_OVERFLOW, schema.EVENT_GROWTH))
    return _first(
        _steps(rows[:, column.step], "step"),
        _scales(rows[:, column.scale_before]),
        _scales(rows[:, column.scale_after]),
        f"has event kind {kinds[bad_kind][0]!r}" if bad_kind.any() else None,
    )


def _loss_scale_progress(rows: np.ndarray) -> str | None:
    column = schema.LOSS_SCALE_PROGRESS_COLUMN
    return _first(
        _steps(rows[:, column.steps_run], "steps_run"),
        _scales(rows[:, column.scale]),
        _steps(rows[:, column.skipped_steps], "skipped_steps"),
    )


def _gpu_samples(rows: np.ndarray) -> str | None:
    columns = schema.GPU_SAMPLE_COLUMNS
    wall_times = rows[:, columns.index("wall_time")]
    return _first(
        None if np.all(np.isfinite(wall_times)) else "has a wall_time that is not finite",
        _steps(rows[:, columns.index("step")], "step"),
        _steps(rows[:, columns.index("device")], "device"),
    )


def _numerics_step(rows: np.ndarray) -> str | None:
    columns = schema.NUMERICS_STEP_COLUMNS
    return _first(
        _steps(rows[:, columns.index("step")], "step"),
        _steps(rows[:, columns.index("steps_covered")], "steps_covered"),
    )


def _numerics_stats(rows: np.ndarray) -> str | None:
    return _counts(rows[:, : len(schema.NUMERICS_COUNT_COLUMNS)])


def _float8_state(rows: np.ndarray) -> str | None:
    columns = schema.FLOAT8_STATE_COLUMNS
    scales = rows[..., columns.index("scale")]
    counted = rows[..., columns.index("steps"):]
    return _first(
        None if np.all(scales >= 0) else f"has float8 scale {scales[~(scales >= 0)][0]!r}",
        # "steps" and its counts are NaN where the replay did not hold.
        _counts(counted[~np.isnan(counted)]),
    )


def _float8_shares(rows: np.ndarray) -> str | None:
    column = schema.FLOAT8_SHARE_COLUMN
    counts = rows[:, : len(schema.FLOAT8_SHARE_COUNT_COLUMNS)]
    more = (rows[:, column.nonzero] > rows[:, column.count]) | (
        rows[:, column.saturated] > rows[:, column.count]) | (
        rows[:, column.underflowed] > rows[:, column.nonzero])
    scales = rows[:, column.scale]
    return _first(
        _counts(counts),
        "counts more non-zero, saturated or underflowed values than values" if more.any()
        else None,
        None if np.all(scales >= 0) else f"has float8 scale {scales[~(scales >= 0)][0]!r}",
        _counts(rows[:, column.abs_max]),
    )


def _float8_replicas(rows: np.ndarray) -> str | None:
    column = schema.FLOAT8_REPLICA_COLUMN
    return _first(
        _steps(rows[:, column.replicas], "replicas"),
        _counts(rows[:, column.amax_last_min:]),
    )


_STATS = (len(schema.NUMERICS_STAT_COLUMNS), _numerics_stats)
# A histogram has a bin per gap between the layout's edges, plus two open
# ends: `Run.numerics` matches its width against the layout.
_HISTOGRAM = (None, _counts)

# Per array record: columns of each row (None: any), and the check of the rows.
_ARRAY_RECORDS: dict[str, tuple[int | None, Callable[[np.ndarray], str | None]]] = {
    schema.LOSS_SCALE_EVENTS: (len(schema.LOSS_SCALE_EVENT_COLUMNS), _loss_scale_events),
    schema.LOSS_SCALE_PROGRESS: (len(schema.LOSS_SCALE_PROGRESS_COLUMNS), _loss_scale_progress),
    schema.GPU_SAMPLES: (len(schema.GPU_SAMPLE_COLUMNS), _gpu_samples),
    schema.NUMERICS_STEP: (len(schema.NUMERICS_STEP_COLUMNS), _numerics_step),
    schema.NUMERICS_FORWARD: _STATS,
    schema.NUMERICS_BACKWARD: _STATS,
    schema.NUMERICS_GRADIENTS: _STATS,
    schema.NUMERICS_UNSCALED_GRADIENTS: _STATS,
    schema.NUMERICS_FORWARD_HIST: _HISTOGRAM,
    schema.NUMERICS_BACKWARD_HIST: _HISTOGRAM,
    schema.FLOAT8_STATE: (len(schema.FLOAT8_STATE_COLUMNS), _float8_state),
    schema.FLOAT8_SHARES: (len(schema.FLOAT8_SHARE_COLUMNS), _float8_shares),
    schema.FLOAT8_REPLICAS: (len(schema.FLOAT8_REPLICA_COLUMNS), _float8_replicas),
}
