"""Findings: rules over a read run that say what is wrong and what to change.

The only place in mpprof that judges. Each rule is a function of a run,
declared once in the registry (`core.REGISTRY`) with its code, severity,
title and the dashboard view that shows its evidence; rule families live in
their own modules (loss_scale, numerics, underflow, nonfinite, precision,
hardware). A rule returns `Finding`s or says "not measured" / "not
applicable". Codes are a public interface, documented in docs/findings.md.

    run = mpprof.records.reader.read_logdir("logs")["train"]
    result = mpprof.diagnosis.evaluate(run)
    for finding in result.findings:
        print(finding.code, finding.title)
    for note in result.notes:            # what could not be judged, and why
        print(note.code, note.status, note.reason)
"""

from __future__ import annotations

# Importing the rule modules registers their rules.
from mpprof.diagnosis import (
    failure,
    float8,
    hardware,
    loss_scale,
    nonfinite,
    numerics,
    precision,
    underflow,
)
from mpprof.diagnosis.core import (
    REGISTRY,
    SEVERITIES,
    VIEWS,
    Check,
    Diagnosis,
    Finding,
    NotApplicable,
    NotMeasured,
    Rule,
)
from mpprof.diagnosis.float8 import (
    FLOAT8_STEP_SHARE,
    FLOAT8_UNDERFLOW_SHARE,
    MIN_FLOAT8_STEPS,
    REPLICA_AMAX_TOLERANCE,
    SATURATION_FACTOR,
    SATURATION_SHARE,
    WARMUP_STEPS,
)
from mpprof.diagnosis.hardware import (
    BF16_CAPABILITY,
    BUSY_GPU_UTIL_PERCENT,
    FP16_TENSOR_CORE_CAPABILITY,
    LOW_TENSOR_CORE_SHARE,
    LOW_TENSOR_UTIL_PERCENT,
)
from mpprof.diagnosis.loss_scale import (
    EXCESS_OVERFLOW_SHARE,
    FLOOR_OVERFLOWS_LIMIT,
    MIN_EXCESS_OVERFLOWS,
    MIN_HEALTHY_LOSS_SCALE,
)
from mpprof.diagnosis.numerics import (
    FLUSH_GAP,
    FLUSH_SHARE,
    HEADROOM_FACTOR,
    MAX_LAYER_FINDINGS,
    MIN_UNDERFLOW_SAMPLES,
    UNDERFLOW_SHARE,
)
from mpprof.diagnosis.precision import MIN_GEMM_FLOPS_SHARE
from mpprof.diagnosis.text import exceeds, format_text
from mpprof.diagnosis.view import (
    RunView,
    backward_overflow_mask,
    first_backward_offender,
    first_forward_offender,
    forward_overflow_mask,
    gradient_underflow_share,
    inventory_missing_reason,
)
from mpprof.dtypes import FLOAT8_GEMM_MULTIPLE, TENSOR_CORE_MULTIPLE

# The catalogue, in code order.
CATALOGUE: dict[str, Rule] = dict(sorted(REGISTRY.items()))

__all__ = [
    "BF16_CAPABILITY", "BUSY_GPU_UTIL_PERCENT", "CATALOGUE", "EXCESS_OVERFLOW_SHARE",
    "FLOAT8_STEP_SHARE", "FLOAT8_UNDERFLOW_SHARE", "FLOOR_OVERFLOWS_LIMIT", "FLUSH_GAP",
    "FLOAT8_GEMM_MULTIPLE", "FLUSH_SHARE",
    "FP16_TENSOR_CORE_CAPABILITY",
    "HEADROOM_FACTOR", "LOW_TENSOR_CORE_SHARE", "LOW_TENSOR_UTIL_PERCENT",
    "MAX_LAYER_FINDINGS", "MIN_EXCESS_OVERFLOWS", "MIN_FLOAT8_STEPS", "MIN_GEMM_FLOPS_SHARE",
    "MIN_HEALTHY_LOSS_SCALE",
    "MIN_UNDERFLOW_SAMPLES", "REPLICA_AMAX_TOLERANCE", "SATURATION_FACTOR", "SATURATION_SHARE",
    "SEVERITIES",
    "TENSOR_CORE_MULTIPLE",
    "UNDERFLOW_SHARE", "VIEWS", "WARMUP_STEPS", "Check", "Diagnosis", "Finding", "Rule", "RunView",
    "backward_overflow_mask", "diagnose", "evaluate", "exceeds",
    "first_backward_offender", "first_forward_offender", "format_text",
    "failure", "float8", "forward_overflow_mask", "gradient_underflow_share", "hardware",
    "inventory_missing_reason", "loss_scale",
    "nonfinite", "numerics", "precision", "underflow",
]


def diagnose(run, *, assume_gpu: bool = False) -> list[Finding]:
    """The findings of `run` (a `mpprof.records.reader.Run`): most severe first, by step."""
    return evaluate(run, assume_gpu=assume_gpu).findings


def evaluate(run, *, assume_gpu: bool = False) -> Diagnosis:
    """The findings of `run` and, for every rule, whether it could check.

    Args:
        run: a `mpprof.records.reader.Run`.
        assume_gpu: judge what matters only on a GPU (MP007's Tensor Core
            shapes) on a run that had none, as a projection that says so.

    Returns:
        A `Diagnosis`: `.findings` most severe first, then by step; `.checks`
        one per rule; `.notes` the rules that could not judge, with why.
    """
    view = RunView(run, assume_gpu=assume_gpu)
    findings: list[Finding] = []
    checks: list[Check] = []
    worker = getattr(run, "worker", None)
    for code, rule in CATALOGUE.items():
        if worker is not None and not rule.host:
            checks.append(Check(code, "not applicable", (
                f"run of worker {worker['index']} of a multi-worker fit: the model-level "
                f"records are judged in run {worker['model_run']!r}, written by the chief"
            )))
            continue
        try:
            found = rule.judge(view)
        except NotMeasured as e:
            checks.append(Check(code, "not measured", str(e)))
            continue
        except NotApplicable as e:
            checks.append(Check(code, "not applicable", str(e)))
            continue
        checks.append(Check(code, "checked"))
        findings.extend(found)
    return Diagnosis(sorted(findings, key=_rank), checks)


def _rank(finding: Finding):
    return (
        SEVERITIES.index(finding.severity),
        finding.step is None,
        finding.step or 0,
        finding.code,
    )
