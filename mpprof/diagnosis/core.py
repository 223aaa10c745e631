"""The registry of rules and what a judgement returns: findings and notes.

Each rule is declared ONCE, with `@rule(...)` above the function that judges
it: its code, severity, title, the dashboard view that shows its evidence,
what data it needs and whether it applies to one worker's own run. Its
documentation is the function's docstring. Everything else (the catalogue,
docs/findings.md's table, a finding's severity and view) is read from here.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable

from mpprof.jsonsafe import json_safe

SEVERITIES = ("critical", "warning", "info")  # most severe first

# The dashboard views that can show a rule's evidence.
VIEWS = ("overview", "loss_scale", "numerics", "inventory", "gpu", "float8")


@dataclasses.dataclass(frozen=True)
class Rule:
    """A catalogue entry.

    Attributes:
        code: "MP001".. (stable, public).
        severity: one of `SEVERITIES`.
        title: what the rule is about, in a few words.
        view: the dashboard view that shows its evidence (one of `VIEWS`).
        data: the records it needs, in words (docs/findings.md's table).
        judge: the function `(RunView) -> list[Finding]`.
        host: whether it judges one host's hardware, and so also applies to
            a worker's own run of a multi-worker fit.
        doc: the judge's docstring: when the rule fires.
    """

    code: str
    severity: str
    title: str
    view: str
    data: str
    judge: Callable = dataclasses.field(repr=False, compare=False)
    host: bool = False
    doc: str = ""

    @property
    def summary(self) -> str:
        return self.title


REGISTRY: dict[str, Rule] = {}


def rule(code: str, severity: str, title: str, *, view: str, data: str, host: bool = False):
    """Declares the decorated function as the judge of rule `code`.

    Args:
        code: the rule's code, "MP0NN".
        severity: one of `SEVERITIES`.
        title: what the rule is about, in a few words.
        view: one of `VIEWS`.
        data: the records it needs, in words.
        host: whether it also applies to a worker's own run.
    """
    if severity not in SEVERITIES or view not in VIEWS:
        raise ValueError(f"{code}: bad severity {severity!r} or view {view!r}")

    def register(judge):
        if code in REGISTRY:
            raise ValueError(f"rule {code} declared twice")
        REGISTRY[code] = Rule(
            code, severity, title, view, data, judge, host, inspect.getdoc(judge) or ""
        )
        return judge

    return register


class NotMeasured(Exception):
    """The data a rule needs was not recorded."""


class NotApplicable(Exception):
    """The rule cannot apply to this run (e.g. float32 training)."""


@dataclasses.dataclass(frozen=True)
class Finding:
    """One thing wrong (or worth knowing) about a run.

    Attributes:
        code: the catalogue code.
        severity: one of `SEVERITIES`.
        title: one line saying what is wrong.
        layer: the layer it concerns (its full inventory path), or None.
        step: the first train step where the evidence was seen, or None.
        evidence: the numbers that triggered it (JSON-ready).
        fix: the concrete change to make, possibly with a code snippet.
        view: the dashboard view that shows the evidence; by default the
            rule's (see `REGISTRY`).
    """

    code: str
    severity: str
    title: str
    layer: str | None
    step: int | None
    evidence: dict
    fix: str
    view: str | None = None

    def __post_init__(self):
        if self.view is None:
            registered = REGISTRY.get(self.code)
            object.__setattr__(self, "view", registered.view if registered else "overview")

    def to_dict(self) -> dict:
        """A JSON-ready dict with every field (non-finite numbers as "inf"/"nan")."""
        return json_safe(dataclasses.asdict(self))


def finding(code: str, title: str, *, layer=None, step=None, evidence: dict, fix: str) -> Finding:
    """A finding of rule `code`, with the severity and view it was declared with."""
    registered = REGISTRY[code]
    return Finding(code, registered.severity, title, layer, step, evidence, fix, registered.view)


@dataclasses.dataclass(frozen=True)
class Check:
    """Whether a rule could look at a run.

    Attributes:
        code: the rule's code.
        status: "checked", "not measured" (the data it needs was not
            recorded) or "not applicable" (it cannot apply to this run).
        reason: why, for the last two; what to record to measure it.
    """

    code: str
    status: str
    reason: str = ""

    def to_dict(self) -> dict:
        """{"code", "status", "reason", "title", "view"}: a note to list under
        the findings."""
        registered = REGISTRY.get(self.code)
        return {
            "code": self.code,
            "status": self.status,
            "reason": self.reason,
            "title": registered.title if registered else "",
            "view": registered.view if registered else "overview",
        }


@dataclasses.dataclass(frozen=True)
class Diagnosis:
    """Every finding of a run and what each rule could check."""

    findings: list[Finding]
    checks: list[Check]

    @property
    def not_measured(self) -> list[Check]:
        return [c for c in self.checks if c.status == "not measured"]

    @property
    def notes(self) -> list[Check]:
        """The rules that could not judge: "not measured" first, then "not
        applicable", each in code order."""
        return sorted(
            (c for c in self.checks if c.status != "checked"),
            key=lambda c: (c.status != "not measured", c.code),
        )

    def to_dict(self) -> dict:
        """{"findings": [Finding.to_dict()...], "notes": [Check.to_dict()...]}."""
        return {
            "findings": [f.to_dict() for f in self.findings],
            "notes": [c.to_dict() for c in self.notes],
        }
