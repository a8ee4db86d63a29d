"""The driver's guards against runs that go on without progress: groups that keep arriving too stale to
train, and a checkpoint that cannot be written (``failed_save``: stop saying which write failed, or go on).

A stale streak: while stale groups keep arriving the group timeout never fires (something did arrive), yet no
step is taken; ``StaleStreak`` counts the groups dropped in a row and says when the count passes its limit, so
the run can end saying why (staleness, groups in flight, learner step time) instead of spinning.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from sliderl.cluster.errors import RunError


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


def failed_save(checkpoints, step: int, err: BaseException, on_error: str, run_dir: Path | str) -> None:
    """After checkpoint ``step`` failed to save: remove what it wrote (it has no marker, so a resume would
    never pick it), then raise a RunError naming the failed write and the checkpoint a resume picks, or with
    ``on_error`` "continue" warn and return."""
    folder = checkpoints.path(step)
    try:
        checkpoints.storage.delete(folder)
    except OSError:  # left for the next save of this step (or nobody): it has no marker
        pass
    complete = checkpoints.complete()
    previous = f"the previous checkpoint {complete[-1].name} is intact" if complete else "no checkpoint exists yet"
    what = f"checkpoint {folder.name} could not be written ({save_failure(err)}); {previous}"
    if on_error == "stop":
        raise RunError(f"{what} (resume=true continues from it); free or fix {run_dir}, or set "
                       "checkpoint.on_error=continue to go on without checkpoints that fail")
    print(f"sliderl: warning: {what}; the run goes on (checkpoint.on_error=continue)", file=sys.stderr, flush=True)
