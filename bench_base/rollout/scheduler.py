"""Continuous batching: which sequences run this step, with how many tokens, and who is preempted."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from rollout.block_manager import BlockManager
from rollout.sequence import Sequence, Status


@dataclass
class ScheduledBatch:
    """This step's work: ``num_tokens[i]`` consecutive uncomputed tokens of ``seqs[i]``."""

    seqs: list[Sequence] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)

    def add(self, seq: Sequence, n: int) -> None:
        self.seqs.append(seq)
        self.num_tokens.append(n)

    def __len__(self) -> int:
        return len(self.seqs)


class Scheduler:
    """Running sequences first (decode or the next prefill chunk), then admissions from the queue.

    When a running sequence needs a block and none is free, the most recently admitted sequence
    is preempted: its blocks go back to the pool and it is recomputed from its tokens later.
    """

    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.blocks = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self._schedule_running(batch, self.max_num_batched_tokens)
        self._admit_waiting(batch, budget)
        return batch

    def _schedule_running(self, batch: ScheduledBatch, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = self._fit(seq, min(seq.num_uncomputed, budget))
            while n == 0 and self.running[-1] is not seq:
                self._preempt(self.running[-1])
                n = self._fit(seq, min(seq.num_uncomputed, budget))
            if n == 0:
                if len(self.running) == 1:
                    raise RuntimeError(
                        f"the KV pool ({self.blocks.num_blocks} blocks) cannot hold request {seq.request_id} alone "
                        f"at {seq.num_computed} tokens; raise num_blocks / kv_cache_gb or use a bounded KV policy")
                self._preempt(seq)
                break
            self.allocate(seq, n)
            batch.add(seq, n)
            budget -= n
            i += 1
        return budget

    def _admit_waiting(self, batch: ScheduledBatch, budget: int) -> None:
        reserve = len(self.running)  # keep a block per running sequence for its next decode
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            n = self._fit(seq, min(seq.num_uncomputed, budget), reserve=reserve)
            if n == 0:
                break
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            self.allocate(seq, n)
            batch.add(seq, n)
            budget -= n
            reserve += 1

    def _fit(self, seq: Sequence, n: int, reserve: int = 0) -> int:
        """The most of the next ``n`` tokens whose blocks can be allocated now."""
        bs = seq.block_size
        first = seq.num_computed // bs
        room = (first + 1) * bs - seq.num_computed if first in seq.blocks else 0
        return min(n, room + max(0, self.blocks.num_free - reserve) * bs)

    def allocate(self, seq: Sequence, n: int) -> None:
        """Blocks for the next ``n`` positions of ``seq`` (the caller checked that the pool has them)."""
        bs = seq.block_size
        for j in range(seq.num_computed // bs, (seq.num_computed + n - 1) // bs + 1):
            if j not in seq.blocks:
                seq.add_block(j, self.blocks.allocate())
        seq.kv.peak_blocks = max(seq.kv.peak_blocks, len(seq.blocks))

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        for block in seq.reset_for_recompute():
            self.blocks.free(block)
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def free_dead_blocks(self, seq: Sequence) -> None:
        for block in seq.pop_dead_blocks():
            self.blocks.free(block)

    def finish(self, seq: Sequence) -> None:
        self.running.remove(seq)
        for block in seq.release_blocks():
            self.blocks.free(block)
        seq.status = Status.FINISHED
