"""The driver's books on groups: dealt, held by which worker, received, and how each one ended.

Every group dealt is *outstanding* until it is resolved exactly once: trained, or dropped as
stale. A group can arrive twice (a worker died after finishing it and the driver re-issued it);
the second arrival is counted as a duplicate and never trained. Plain Python (no Ray), so its
invariants are tested directly:

    resolved = trained + stale, disjoint, no id twice
    every arrival is ready, resolved, or a duplicate
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from sliderl.cluster.records import PromptGroup, RolloutGroup


@dataclass
class Take:
    """Groups handed to one learner step and those dropped on the way (too stale or from a later version)."""

    groups: list[RolloutGroup] = field(default_factory=list)  # in arrival order
    stale: list[RolloutGroup] = field(default_factory=list)


@dataclass(frozen=True)
class LedgerState:
    """The ledger's history, as a checkpoint keeps it: group ids in the order they happened."""

    trained: list[str] = field(default_factory=list)
    """groups trained, each exactly once"""
    stale: list[str] = field(default_factory=list)
    """groups dropped as too stale (or from a newer version), never trained"""
    duplicates: list[str] = field(default_factory=list)
    """second arrivals of a group, never trained"""
    reissued: list[str] = field(default_factory=list)
    """groups dealt again after their worker died or restarted"""


class GroupLedger:
    """Bookkeeping of groups between the prompt stream, the workers and the learner.

    ``GroupLedger(state)`` continues the books of a checkpoint: the groups it resolved stay
    resolved, so a late arrival of one of them is a duplicate.
    """

    def __init__(self, state: LedgerState | None = None):
        state = state or LedgerState()
        self.outstanding: dict[str, PromptGroup] = {}
        self.held: dict[int, set[str]] = {}
        self.ready: deque[RolloutGroup] = deque()  # received and not yet resolved
        self.trained: list[str] = list(state.trained)
        self.stale: list[str] = list(state.stale)
        self.duplicates: list[str] = list(state.duplicates)
        self.reissued: list[str] = list(state.reissued)
        self._resolved: set[str] = set(self.trained + self.stale)
        self._arrived: set[str] = set()

    def state(self) -> LedgerState:
        """A copy of the books for a checkpoint (``GroupLedger(state)`` continues from it)."""
        return LedgerState(trained=list(self.trained), stale=list(self.stale), duplicates=list(self.duplicates),
                           reissued=list(self.reissued))

    def deal(self, worker_id: int, groups: list[PromptGroup]) -> None:
        """``groups`` were submitted to ``worker_id``."""
        for group in groups:
            self.outstanding[group.group_id] = group
            self.held.setdefault(worker_id, set()).add(group.group_id)

    def held_by(self, worker_id: int) -> int:
        return len(self.held.get(worker_id, ()))

    def receive(self, group) -> bool:
        """A RolloutGroup came out of the queue; False (and counted) when it is a duplicate."""
        self.held.get(group.worker_id, set()).discard(group.group_id)
        if group.group_id in self._resolved or group.group_id in self._arrived \
                or group.group_id not in self.outstanding:
            self.duplicates.append(group.group_id)
            return False
        self._arrived.add(group.group_id)
        self.ready.append(group)
        return True

    def orphans(self, worker_id: int) -> list[PromptGroup]:
        """Groups a dead (or restarted) worker held and nobody received: to be re-issued."""
        ids = self.held.pop(worker_id, set())
        groups = [self.outstanding[g] for g in sorted(ids) if g in self.outstanding and g not in self._arrived]
        self.reissued.extend(g.group_id for g in groups)
        return groups

    def take(self, n: int, version: int, max_staleness: int | None) -> Take:
        """Up to ``n`` ready groups fit to train at ``version``; unfit ones met on the way are dropped.

        A group is unfit when it was sampled more than ``max_staleness`` versions ago (None: never)
        or under a version newer than ``version`` (weights rolled back by a resume).
        """
        take = Take()
        while self.ready and len(take.groups) < n:
            group = self.ready.popleft()
            age = version - group.policy_version
            if age < 0 or (max_staleness is not None and age > max_staleness):
                self._resolve(group.group_id)
                self.stale.append(group.group_id)
                take.stale.append(group)
            else:
                take.groups.append(group)
        return take

    def mark_trained(self, groups: list) -> None:
        for group in groups:
            self._resolve(group.group_id)
            self.trained.append(group.group_id)

    def outstanding_indices(self) -> list[int]:
        """Stream indices of the outstanding groups (ids ``g{n:08d}``), for a checkpoint."""
        return sorted(int(g[1:]) for g in self.outstanding)

    def _resolve(self, group_id: str) -> None:
        assert group_id not in self._resolved, f"group {group_id} resolved twice"
        self._resolved.add(group_id)
        self.outstanding.pop(group_id, None)
