"""Names, tags, record types and versions of mpprof's data in a logdir.

The one place that says what mpprof writes. `mpprof.writer` writes these
records and `mpprof.reader` reads them back; both import the names from here,
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

# One JSON object: versions, policies, optimizer, devices, collector states.
RUN_CONTEXT = "run_context"
# One JSON object: {"layers": [...], "casts": [...], "model_outputs": [...]}.
INVENTORY = "inventory"
# float64 [n, len(LOSS_SCALE_EVENT_COLUMNS)]: every overflow and growth.
LOSS_SCALE_EVENTS = "loss_scale/events"
# float64 [len(LOSS_SCALE_PROGRESS_COLUMNS)]: where training stood at a read.
LOSS_SCALE_PROGRESS = "loss_scale/progress"

RECORDS = (RUN_CONTEXT, INVENTORY, LOSS_SCALE_EVENTS, LOSS_SCALE_PROGRESS)

LOSS_SCALE_EVENT_COLUMNS = ("step", "scale_before", "scale_after", "kind")
LOSS_SCALE_PROGRESS_COLUMNS = ("steps_run", "scale", "skipped_steps")

# Values of the "kind" column of LOSS_SCALE_EVENTS.
EVENT_OVERFLOW = 0.0  # non-finite gradients: step skipped, scale halved
EVENT_GROWTH = 1.0  # dynamic_growth_steps finite steps in a row: scale doubled

# Largest finite float16 and the smallest positive normal/subnormal ones.
FLOAT16_MAX = 65504.0
FLOAT16_SMALLEST_NORMAL = 2.0**-14
FLOAT16_SMALLEST_SUBNORMAL = 2.0**-24
BFLOAT16_MAX = 3.3895313892515355e38


def tag_for(record: str) -> str:
    """The summary tag under which `record` is written."""
    if record not in RECORDS:
        raise ValueError(f"Unknown mpprof record {record!r}; known: {RECORDS}")
    return TAG_PREFIX + record


def record_for_tag(tag: str) -> str | None:
    """The record name of a summary tag, or None if it is not mpprof's."""
    if not tag.startswith(TAG_PREFIX):
        return None
    record = tag[len(TAG_PREFIX) :]
    return record if record in RECORDS else None


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
