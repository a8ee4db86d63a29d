"""The driver's guards against runs that go on without progress: groups that keep arriving too stale to
train, and a checkpoint that cannot be written.

A stale streak: while stale groups keep arriving the group timeout never fires (something did arrive), yet no
step is taken; ``StaleStreak`` counts the groups dropped in a row and says when the count passes its limit, so
the run can end saying why (staleness, groups in flight, learner step time) instead of spinning.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StaleStreak:
    """Groups dropped as too stale since the last one fit to train."""

    limit: int
    count: int = 0
    oldest_version: int | None = None  # the version the last dropped group was sampled at

    def observe(self, taken: int, dropped_versions: list[int]) -> bool:
        """A ``Take`` of ``taken`` trainable groups and dropped ones sampled at ``dropped_versions``; True once
        more than ``limit`` groups in a row were dropped."""
        if taken:
            self.count, self.oldest_version = 0, None
        if dropped_versions:
            self.count += len(dropped_versions)
            self.oldest_version = dropped_versions[-1]
        return self.count > self.limit


def stale_streak_limit(setting: int | None, in_flight: int, queue_size: int, groups_per_step: int) -> int:
    """``train.max_stale_streak``, or when None: twice every group that can be waiting at once (in flight,
    queued, one step's worth ready), which even a learner step long enough to age them all cannot exceed."""
    return setting if setting is not None else 2 * (in_flight + queue_size + groups_per_step)


def stale_streak_message(streak: StaleStreak, version: int, max_staleness: int, in_flight: str,
                         mean_step_s: float | None) -> str:
    step = f"{mean_step_s:.1f} s" if mean_step_s is not None else "not measured yet"
    return (f"{streak.count} groups in a row arrived too stale to train (the last sampled at version "
            f"{streak.oldest_version}, the learner at {version}; train.max_staleness={max_staleness}) with "
            f"{in_flight} in flight and a mean learner step of {step}: the workers do not catch up with the "
            "weights (or one does not apply them); lower rollout.max_inflight_groups, raise train.max_staleness, "
            "or see the workers' weight versions (train.max_stale_streak sets this limit)")


def save_failure(err: BaseException) -> str:
    """Which write of a checkpoint failed and why, from the error (the learner's OSError inside a RayTaskError,
    or the driver's own)."""
    cause = getattr(err, "cause", None) or err
    if isinstance(cause, OSError):
        where = f" {cause.filename}" if cause.filename else ""
        return f"writing{where} failed: {cause.strerror or cause}"
    return f"{type(cause).__name__}: {' '.join(str(cause).split())[:300]}"
