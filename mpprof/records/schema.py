"""Names, tags, record types and versions of mpprof's data in a logdir.

The one place that says what mpprof writes. `mpprof.records.writer` writes these
records and `mpprof.records.reader` reads them back; both import the names from here,
so a record type is defined once.

Every record is a TensorBoard tensor summary with plugin name `mpprof`,
`data_class` DATA_CLASS_TENSOR and JSON plugin content
`{"version": SCHEMA_VERSION, "record": <record name>}`. Structured records
(run context, inventory) are one JSON string; series are float64 arrays whose
columns are listed here.
"""

from __future__ import annotations

import json

PLUGIN_NAME = "mpprof"

# Version of the record layout. Bump it when a record changes shape, and
# teach the reader to read every older version.
SCHEMA_VERSION = 1

# Subdirectory of log_dir the callback writes into, beside what
# keras.callbacks.TensorBoard writes there.
TRAIN_RUN = "train"

TAG_PREFIX = "mpprof/"

# mpprof's event files end with this, so readers skip everyone else's.
EVENT_FILE_SUFFIX = ".mpprof.v2"
# On a remote file system (an object store cannot append) a writer writes each
# flush as a new object, a part of its event file: `<event file name>.part<n>`
# with n zero-padded, so name order is write order. Each part begins with the
# file-version event: it is a complete event file on its own, which
# TensorBoard's loaders (reading every name that holds "tfevents", in name
# order) read like a writer's successive files, and the reader joins.
PART_MARK = ".part"
PART_DIGITS = 8


def part_name(event_file_name: str, index: int) -> str:
    """The name of part `index` (0, 1, ...) of the event file `event_file_name`."""
    return f"{event_file_name}{PART_MARK}{index:0{PART_DIGITS}d}"


def event_file_base(name: str) -> str | None:
    """The writer's event file name of `name` (an mpprof event file, or a
    part of one), or None when `name` is no mpprof event file."""
    if "tfevents" not in name:
        return None
    if name.endswith(EVENT_FILE_SUFFIX):
        return name
    base, mark, index = name.rpartition(PART_MARK)
    if (mark and base.endswith(EVENT_FILE_SUFFIX) and len(index) == PART_DIGITS
            and index.isdigit() and index.isascii()):
        return base
    return None


# Beside each event file, a small file that says how its writer's fit ended,
# reserved when the writer starts and rewritten in place at the end, so a disk
# that fills midway still lets it say "ended" (an in-place rewrite of a
# reserved block needs no free space). Named without "tfevents": TensorBoard
# reads every file whose name holds that word.
FIT_END_PREFIX = "mpprof.fit_end."
FIT_END_SIZE = 1024


def fit_end_name(event_file_name: str) -> str:
    """The fit-end file of the event file named `event_file_name`."""
    return FIT_END_PREFIX + event_file_name.replace("events.out.tfevents.", "", 1) + ".json"

# One JSON object: versions, policies, optimizer, devices, collector states.
RUN_CONTEXT = "run_context"
# One JSON object: {"layers": [...], "casts": [...], "model_outputs": [...]}.
INVENTORY = "inventory"
# float64 [n, len(LOSS_SCALE_EVENT_COLUMNS)]: every overflow and growth.
LOSS_SCALE_EVENTS = "loss_scale/events"
# float64 [len(LOSS_SCALE_PROGRESS_COLUMNS)]: where training stood at a read.
LOSS_SCALE_PROGRESS = "loss_scale/progress"
# float64 [n, len(GPU_SAMPLE_COLUMNS)]: NVML samples, one row per GPU per round.
GPU_SAMPLES = "gpu/samples"
# One JSON object: Tensor Core share of GPU kernel time from an XProf trace,
# {"source", "tensor_core_share", "total_gpu_kernel_us", "tensor_core_us",
#  "eligible_not_using_us", "top_ops": [...]} or {"no_gpu_kernels": true, ...}.
KERNEL_STATS = "kernels/tensor_core_share"

# One JSON object naming the rows of the numerics records below:
# {"layers": [leaf layer names in call order], "variables": [...],
#  "hist_edges": NUMERICS_HIST_EDGES, "policy_max": ..., "aggregation": ...,
#  "estimated": {"columns", "histograms", "sample_values", "how"}}: which
#  statistics of a large tensor are estimated from a sample of its values
#  (absent from older logs, whose counts are all exact).
NUMERICS_LAYOUT = "numerics/layout"
# One sampled step: float64 [len(NUMERICS_STEP_COLUMNS)].
NUMERICS_STEP = "numerics/step"
# float64 [layers, len(NUMERICS_STAT_COLUMNS)]: each leaf layer's output, and
# the gradient flowing into that output (scaled, as the loss scale sees it).
# "count", "nonfinite" and "abs_max" are exact; of a tensor larger than the
# layout's "estimated"["sample_values"], the "zero", "below_normal" and
# "below_subnormal" counts and the histograms are estimated from that many of
# its values spread evenly over it (each standing for the values around it).
NUMERICS_FORWARD = "numerics/forward"
NUMERICS_BACKWARD = "numerics/backward"
# float64 [layers, len(NUMERICS_HIST_EDGES) + 1]: counts of log2|x| per bin.
NUMERICS_FORWARD_HIST = "numerics/forward_hist"
NUMERICS_BACKWARD_HIST = "numerics/backward_hist"
# float64 [variables, len(NUMERICS_STAT_COLUMNS)]: each trainable variable's
# gradient as the optimizer receives it (scaled) and divided by the scale;
# exact and estimated columns as above.
NUMERICS_GRADIENTS = "numerics/gradients"
NUMERICS_UNSCALED_GRADIENTS = "numerics/unscaled_gradients"
# One JSON object: {"first_nonfinite_loss_step", "first_nonfinite_loss_step_last",
#  "first_nonfinite_loss_count", "nonfinite_loss_steps", "nonfinite_weights":
#  [...], "checked_step"}: the first non-finite loss came at a step from the
# first to the last (equal: exact; a record without "..._last" is exact), and
# that many of those steps had one (a record without it: at least one).
# "loss_guarded_by" (optional): the loss-scale series whose skipped steps
# catch the watched loss (without it: the primary series).
HEALTH = "health"
# One JSON object: {"layers": [{"name", "policy", "amax_history_length"}],
#  "tensors": FLOAT8_TENSORS, "formats": {tensor: format}, "format_max":
#  {format: largest finite}, "format_min_subnormal": {format: smallest positive},
#  "replicas": n, "amax_across_replicas": None | "per replica" | "mean" | ...}:
# the model's float8 layers, in the order of FLOAT8_STATE's rows.
FLOAT8_LAYOUT = "float8/layout"
# float64 [layers, len(FLOAT8_TENSORS), len(FLOAT8_STATE_COLUMNS)] at each flush.
FLOAT8_STATE = "float8/state"
# float64 [layers, len(FLOAT8_TENSORS), len(FLOAT8_SHARE_COLUMNS)] at each
# sampled step (the numerics schedule's), rows as FLOAT8_LAYOUT orders them.
FLOAT8_SHARES = "float8/shares"
# float64 [layers, len(FLOAT8_TENSORS), len(FLOAT8_REPLICA_COLUMNS)] at each
# flush, under a distribution strategy with several replicas only.
FLOAT8_REPLICAS = "float8/replicas"

RECORDS = (
    RUN_CONTEXT, INVENTORY, LOSS_SCALE_EVENTS, LOSS_SCALE_PROGRESS,
    GPU_SAMPLES, KERNEL_STATS, NUMERICS_LAYOUT, NUMERICS_STEP, NUMERICS_FORWARD,
    NUMERICS_BACKWARD, NUMERICS_FORWARD_HIST, NUMERICS_BACKWARD_HIST,
    NUMERICS_GRADIENTS, NUMERICS_UNSCALED_GRADIENTS, HEALTH, FLOAT8_LAYOUT, FLOAT8_STATE,
    FLOAT8_SHARES, FLOAT8_REPLICAS,
)

# Records a run may hold several named series of (see `tag_for`).
SERIES_RECORDS = (LOSS_SCALE_EVENTS, LOSS_SCALE_PROGRESS)
SERIES_SEPARATOR = "@"


LOSS_SCALE_EVENT_COLUMNS = ("step", "scale_before", "scale_after", "kind")
LOSS_SCALE_PROGRESS_COLUMNS = ("steps_run", "scale", "skipped_steps")

# "forensic" is 1 when the sample was taken because of an overflow;
# "steps_covered" is how many steps the sampled execution ran.
NUMERICS_STEP_COLUMNS = ("step", "loss", "loss_scale", "forensic", "steps_covered")
# Counts of values (all, non-finite, exactly zero, non-zero below the float16
# smallest normal, non-zero below the float16 smallest subnormal), then the
# largest finite magnitude.
NUMERICS_COUNT_COLUMNS = ("count", "nonfinite", "zero", "below_normal", "below_subnormal")
NUMERICS_STAT_COLUMNS = NUMERICS_COUNT_COLUMNS + ("abs_max",)
# Finite edges of the log2-magnitude histogram (bins of 2 binades); values
# below the first edge and above the last fall into the two open end bins.
NUMERICS_HIST_EDGES = list(range(-40, 22, 2))

# Columns of GPU_SAMPLES. "device" is the GPU's index as TensorFlow numbers it
# (/GPU:k, after CUDA_VISIBLE_DEVICES); "step" is the train step in progress.
# Utilizations are percent; NaN wherever a value was not measured (the GPM
# columns, up to "fp32_util", exist only on Hopper and newer).
GPU_SAMPLE_COLUMNS = (
    "wall_time", "step", "device",
    "tensor_util",  # GPM: any Tensor Core activity
    "hmma_tensor_util", "imma_tensor_util", "dfma_tensor_util",
    "sm_util", "sm_occupancy", "dram_bw_util", "fp16_util", "fp32_util",
    "gpu_util",  # basic NVML: share of time any kernel ran
    "mem_util", "mem_used_bytes", "mem_total_bytes", "power_w", "sm_clock_mhz",
    "temperature_c", "clock_event_reasons",
)

# The tensors of a Keras float8 layer that are quantized, each with its own
# delayed scale and amax history, and the float8 format Keras gives each.
FLOAT8_TENSORS = ("inputs", "kernel", "outputs_grad")
FLOAT8_FORMATS = {"inputs": "float8_e4m3fn", "kernel": "float8_e4m3fn",
                  "outputs_grad": "float8_e5m2"}
# Columns of FLOAT8_STATE, per layer and tensor. "scale" is the scale variable
# when read (Keras quantizes x as x / scale); "amax_max" and "amax_last" the
# amax history's largest and most recent entry. The rest covers the steps since
# the previous flush, replayed from the amax history with Keras' own scale
# rule: "steps" is how many were replayed (those whose update ran: a step a
# LossScaleOptimizer skipped leaves the float8 state as it was; NaN when the
# replay did not reproduce the history and scale read);
# "saturated_steps" those whose largest value divided by the scale in use
# exceeded the format's max (so Keras clipped it); "peak_over_max" the largest
# such ratio over the format max; "underflowed_steps" those whose largest value
# divided by the scale was at most half the format's smallest subnormal (every
# value quantized to zero); "warmup_steps" those quantized with a scale no amax
# had set yet (the history held only zeros). Shares of individual values are
# FLOAT8_SHARES', on sampled steps.
FLOAT8_STATE_COLUMNS = (
    "scale", "amax_max", "amax_last", "steps", "saturated_steps", "peak_over_max",
    "underflowed_steps", "warmup_steps",
)
# Columns of FLOAT8_SHARES, per layer and tensor, measured in the sampled
# step on the very tensor Keras quantizes, with the scale it quantizes with:
# "count" values, "nonzero" of them non-zero, "saturated" those with
# |x| / scale beyond the format's max (Keras clips them), "underflowed" the
# non-zero ones that quantize to zero; summed over the step's calls of the
# layer (and its replicas). "scale" is the scale used and "abs_max" the
# tensor's largest finite magnitude, both the largest over those calls.
FLOAT8_SHARE_COLUMNS = ("count", "nonzero", "saturated", "underflowed", "scale", "abs_max")
# The columns of FLOAT8_SHARES that add up (the rest take the maximum).
FLOAT8_SHARE_COUNT_COLUMNS = ("count", "nonzero", "saturated", "underflowed")
# Columns of FLOAT8_REPLICAS, per layer and tensor: how many replicas, and the
# least and largest over them of the latest amax and of the amax history's
# max (which sets the scale). Keras keeps one amax history per replica (see
# `mpprof.backends.tensorflow.float8`): far apart, the replicas quantize differently.
FLOAT8_REPLICA_COLUMNS = (
    "replicas", "amax_last_min", "amax_last_max", "amax_max_min", "amax_max_max",
)


class Columns:
    """Column positions by name: `LOSS_SCALE_EVENT_COLUMN.step` is 0. Readers,
    rules and payloads index records through these, never by a bare number."""

    def __init__(self, names: tuple[str, ...]):
        self.names = tuple(names)
        for position, name in enumerate(self.names):
            setattr(self, name, position)

    def __len__(self) -> int:
        return len(self.names)

    def __getattr__(self, name: str) -> int:
        # Reached only for a name that is no column (each column is set above).
        raise AttributeError(f"no column {name!r} among {self.names}")


LOSS_SCALE_EVENT_COLUMN = Columns(LOSS_SCALE_EVENT_COLUMNS)
LOSS_SCALE_PROGRESS_COLUMN = Columns(LOSS_SCALE_PROGRESS_COLUMNS)
NUMERICS_STEP_COLUMN = Columns(NUMERICS_STEP_COLUMNS)
GPU_SAMPLE_COLUMN = Columns(GPU_SAMPLE_COLUMNS)
FLOAT8_STATE_COLUMN = Columns(FLOAT8_STATE_COLUMNS)
FLOAT8_SHARE_COLUMN = Columns(FLOAT8_SHARE_COLUMNS)
FLOAT8_REPLICA_COLUMN = Columns(FLOAT8_REPLICA_COLUMNS)

# Values of the "kind" column of LOSS_SCALE_EVENTS.
EVENT_OVERFLOW = 0.0  # non-finite gradients: step skipped, scale halved
EVENT_GROWTH = 1.0  # dynamic_growth_steps finite steps in a row: scale doubled

# Largest finite float16 and the smallest positive normal/subnormal ones.
FLOAT16_MAX = 65504.0
FLOAT16_SMALLEST_NORMAL = 2.0**-14
FLOAT16_SMALLEST_SUBNORMAL = 2.0**-24
BFLOAT16_MAX = 3.3895313892515355e38


def tag_for(record: str, series: str | None = None) -> str:
    """The summary tag under which `record` is written.

    `series` names one of several series of the same record in a run (the
    loss scale of each LossScaleOptimizer a step uses besides the primary
    one, see SERIES_RECORDS); the primary series has no name.
    """
    if record not in RECORDS:
        raise ValueError(f"Unknown mpprof record {record!r}; known: {RECORDS}")
    if series is None:
        return TAG_PREFIX + record
    if record not in SERIES_RECORDS or not series or SERIES_SEPARATOR in series:
        raise ValueError(f"Record {record!r} cannot have a series named {series!r}")
    return TAG_PREFIX + record + SERIES_SEPARATOR + series


def parse_tag(tag: str) -> tuple[str, str | None] | None:
    """(record, series or None) of a summary tag, or None if it is not mpprof's."""
    if not tag.startswith(TAG_PREFIX):
        return None
    record, _, series = tag[len(TAG_PREFIX) :].partition(SERIES_SEPARATOR)
    if record not in RECORDS or (series and record not in SERIES_RECORDS):
        return None
    return record, series or None


def record_for_tag(tag: str) -> str | None:
    """The record name of a summary tag of the primary series, or None if it
    is not mpprof's (or belongs to a named series)."""
    parsed = parse_tag(tag)
    return parsed[0] if parsed is not None and parsed[1] is None else None


def plugin_content(record: str) -> bytes:
    """The `plugin_data.content` bytes of a summary of `record`."""
    return json.dumps({"version": SCHEMA_VERSION, "record": record}).encode()


def parse_plugin_content(content: bytes) -> dict:
    """Parses `plugin_data.content`; raises ValueError on a newer version."""
    parsed = json.loads(content.decode() or "{}")
    version = parsed.get("version", 0)
    if version > SCHEMA_VERSION:
        raise ValueError(
            f"This logdir was written by a newer mpprof (schema version "
            f"{version}, this one reads up to {SCHEMA_VERSION}): upgrade mpprof."
        )
    return parsed
