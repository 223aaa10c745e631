"""The profiler's settings, checked once when the callback is made."""

from __future__ import annotations

import os
import posixpath
from dataclasses import dataclass

from mpprof.recording import arguments
from mpprof.recording.nvml import sampler
from mpprof.recording.sampling import DefaultInterval
from mpprof.records import schema

# The loss-scale ring holds 2x the steps between two reads: more than this
# many steps between reads would make it large for nothing.
MAX_FLUSH_EVERY_STEPS = 100_000


@dataclass(frozen=True)
class Settings:
    """What a `MixedPrecisionProfiler` was asked to do (see its Args)."""

    log_dir: str
    numerics_every: int | None
    # Whether numerics_every was left at its default (the early samples).
    numerics_default: bool
    forensic_budget: int
    forensic_spacing: int
    flush_every_steps: int
    flush_every_seconds: float | None
    gpu_interval: float | None
    profile_steps: tuple[int, int] | None
    replay_budget: int
    advise_batches: int = 0

    @classmethod
    def checked(
        cls, log_dir: str | os.PathLike, *, numerics_every, forensic_budget, forensic_spacing,
        flush_every_steps, flush_every_seconds, gpu_interval, profile_steps, replay_budget,
        advise_batches=0,
    ) -> Settings:
        """The settings, each argument checked.

        Raises:
            ValueError: an argument is out of range (the message names it).
        """
        return cls(
            log_dir=arguments.log_dir(log_dir),
            numerics_default=isinstance(numerics_every, DefaultInterval),
            numerics_every=(
                None if numerics_every is None
                else arguments.positive_int("numerics_every", numerics_every)
            ),
            forensic_budget=arguments.non_negative_int("forensic_budget", forensic_budget),
            forensic_spacing=arguments.positive_int("forensic_spacing", forensic_spacing),
            flush_every_steps=arguments.positive_int(
                "flush_every_steps", flush_every_steps, at_most=MAX_FLUSH_EVERY_STEPS
            ),
            flush_every_seconds=(
                None if flush_every_seconds is None
                else arguments.seconds("flush_every_seconds", flush_every_seconds,
                                       at_least=0.1, what=", or None")
            ),
            gpu_interval=(
                None if gpu_interval is None else sampler.validate_interval(gpu_interval)
            ),
            profile_steps=arguments.validate_profile_steps(profile_steps),
            replay_budget=arguments.non_negative_int("replay_budget", replay_budget),
            advise_batches=arguments.non_negative_int("advise_batches", advise_batches),
        )

    @property
    def run_dir(self) -> str:
        """The model run's directory, `log_dir/train`."""
        return posixpath.join(self.log_dir, schema.TRAIN_RUN)

    @property
    def sampling(self) -> bool:
        """Whether numerics samples are taken at all."""
        return self.numerics_every is not None
