"""Checks of the profiler's arguments: one error message style, numpy scalars
accepted wherever Python numbers are."""

from __future__ import annotations

import math
import numbers
import os


def positive_int(name: str, value, *, at_most: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or int(value) < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if at_most is not None and int(value) > at_most:
        raise ValueError(f"{name} must be at most {at_most:,}, got {value!r}")
    return int(value)


def non_negative_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    return int(value)


def seconds(name: str, value, *, at_least: float, what: str) -> float:
    """A finite number of seconds >= `at_least`; `what` ends the message."""
    if (isinstance(value, bool) or not isinstance(value, numbers.Real)
            or not math.isfinite(value) or value < at_least):
        raise ValueError(
            f"{name} must be a number of seconds >= {at_least}{what}; got {value!r}"
        )
    return float(value)


def log_dir(value) -> str:
    if not isinstance(value, (str, os.PathLike)):
        raise ValueError(
            f"log_dir must be a path (str or os.PathLike), got {type(value).__name__}"
        )
    path = os.fspath(value)
    if isinstance(path, bytes):
        raise ValueError("log_dir must be a text path, not bytes: decode it first")
    if not path.strip():
        raise ValueError("log_dir must not be empty: pass a directory such as 'logs/run1'")
    if "\x00" in path:
        raise ValueError(f"log_dir must not contain a NUL character, got {path!r}")
    return path

def validate_profile_steps(profile_steps) -> tuple[int, int] | None:
    """`profile_steps` as (start, stop), or None; ValueError if malformed."""
    if profile_steps is None:
        return None
    valid = (
        isinstance(profile_steps, (tuple, list))
        and len(profile_steps) == 2
        and all(isinstance(s, numbers.Integral) and not isinstance(s, bool)
                for s in profile_steps)
        and 0 <= profile_steps[0] <= profile_steps[1]
    )
    if not valid:
        raise ValueError(
            "profile_steps must be None or a pair of train steps (start, stop) with "
            f"0 <= start <= stop, e.g. (10, 15); got {profile_steps!r}"
        )
    return int(profile_steps[0]), int(profile_steps[1])
