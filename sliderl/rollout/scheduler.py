"""Continuous batching: which sequences run this step, with how many tokens, and who is preempted."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from sliderl.rollout.block_manager import BlockManager
from sliderl.rollout.sequence import Sequence, Status


@dataclass
class ScheduledBatch:
    """This step's work: ``num_tokens[i]`` consecutive uncomputed tokens of ``seqs[i]``, and ``dead[i]``, physical
    slots that row's sequence left empty (Pasta threads): their keys must read as dead before the forward."""

    seqs: list[Sequence] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)
    computed: bool = False  # its tokens were marked computed (``mark_computed``)
    budget_ran_out: bool = False  # running sequences were left out: the token budget ended before their turn
    dead: list[list[int]] = field(default_factory=list)

    def add(self, seq: Sequence, n: int, dead: list[int] | None = None) -> None:
        self.seqs.append(seq)
        self.num_tokens.append(n)
        self.dead.append(dead or [])

    def __len__(self) -> int:
        return len(self.seqs)

    def tokens_of(self, seq: Sequence) -> int:
        """How many of ``seq``'s tokens this batch computes (0 when it has no row)."""
        return next((n for s, n in zip(self.seqs, self.num_tokens) if s is seq), 0)

    def dead_slots(self) -> list[int]:
        return [slot for slots in self.dead for slot in slots]

    def drop_request(self, request_id: int) -> None:
        """Remove the rows of a request preempted while this batch was being scheduled."""
        keep = [i for i, s in enumerate(self.seqs) if s.request_id != request_id]
        self.seqs, self.num_tokens = [self.seqs[i] for i in keep], [self.num_tokens[i] for i in keep]
        self.dead = [self.dead[i] for i in keep]

    def input_ids(self) -> list[int]:
        """The tokens this step feeds, flattened in row order."""
        ids = []
        for seq, n in zip(self.seqs, self.num_tokens):
            ids.extend(seq.token_ids[seq.num_computed:seq.num_computed + n])
        return ids

    def sampling_rows(self) -> list[int]:
        """Rows whose tokens reach their sequence's last token: they sample this step (before ``mark_computed``)."""
        return [i for i, (s, n) in enumerate(zip(self.seqs, self.num_tokens)) if s.num_computed + n == len(s.token_ids)]

    def mark_computed(self) -> None:
        """The step's K/V is in the cache (or queued to be, before anything reads it); once only."""
        if not self.computed:
            for seq, n in zip(self.seqs, self.num_tokens):
                seq.mark_computed(n)
            self.computed = True


class Scheduler:
    """Running sequences first (decode or the next prefill chunk), then admissions from the queue.

    Under a bounded policy (``admit_by_bound``) a request is admitted only while its block bound
    (``Sequence.block_bound``) and the running sequences' bounds fit the pool together: a running
    sequence always finds its next block free, so none is ever preempted. Under ``full``,
    ``registers`` and ``pasta`` a request is admitted while its first chunk leaves free a block per running
    sequence plus ``watermark_blocks``; when a running sequence then needs a block and none is free,
    the most recently admitted request is preempted: its blocks go back to the pool and it is
    recomputed from its tokens later. Under h2o a decode step's pages over the budget are evicted
    just before the step is allocated (``evict``), so its block table is the first to lack them.

    A request may run as several sequences (the threads of a Pasta request, ``rollout.pasta.runtime``):
    ``running`` keeps each request's threads together, in admission order of the requests; a step
    schedules them in ``Sequence.threads()`` order, each as far as ``Sequence.ready_tokens`` allows, and
    preemption takes a whole request. The oldest request is never preempted for another, so it always
    progresses: with every request's bound within the pool (``LLM.add_request``) nothing deadlocks.
    """

    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, *, admit_by_bound: bool, watermark_blocks: int):
        self.blocks = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.admit_by_bound = admit_by_bound
        self.watermark_blocks = watermark_blocks
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def reserved_blocks(self) -> int:
        """The most blocks the running sequences can hold together (the sum of their bounds)."""
        return sum(seq.block_bound for seq in self.running)

    def can_admit(self, seq: Sequence) -> bool:
        """Whether ``seq`` may join the running sequences now, as far as their number and bounds go
        (the blocks of its first chunk are ``_fit``'s to check)."""
        if len(self.running) >= self.max_num_seqs:
            return False
        return not self.admit_by_bound or self.reserved_blocks + seq.block_bound <= self.blocks.num_blocks

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self._schedule_running(batch, self.max_num_batched_tokens)
        self._admit_waiting(batch, budget)
        return batch

    def schedule_ahead(self, batch: ScheduledBatch) -> ScheduledBatch | None:
        """The next decode step of ``batch``'s sequences, allocated now, before ``batch``'s sampled tokens are known.

        Only when that step is certain to be needed as it is: every sequence samples in ``batch``, no
        request that could be admitted now waits and the token budget left no running sequence out of ``batch``
        (either would be starved: the queued steps hold ``batch``'s sequences alone), budget forcing cannot replace a sampled
        token, no Pasta request has a change not yet scheduled (``Sequence.may_run_ahead``), every sequence stays
        within ``max_model_len``, and the pool has the blocks without preempting anyone. ``batch`` is then marked
        computed. A sequence whose row in ``batch`` is its last (``Sequence.samples_on``: a Pasta fork writing
        its ``</async>``) gets none; the rows follow ``batch``'s order. (A register kill is known only once the
        tokens are read: the queued forward masks the killed step itself, ``kernels.metadata.register_kills``.)
        """
        if ((self.waiting and self.can_admit(self.waiting[0])) or batch.budget_ran_out
                or len(batch.sampling_rows()) != len(batch)):
            return None  # queued steps hold only ``batch``'s sequences: those left out would wait behind them
        new_blocks, going = 0, [seq for seq in batch.seqs if seq.samples_on]
        for seq in going:
            i = len(seq.token_ids)  # the queued row computes the token sampled in ``batch``, index i
            if seq.may_be_forced or not seq.may_run_ahead or seq.rope_positions(i, 1)[0] + 2 > self.max_model_len:
                return None
            new_blocks += seq.table_positions(i, 1)[0] // seq.block_size not in seq.blocks
        if not going or new_blocks > self.blocks.num_free:
            return None
        batch.mark_computed()
        nxt = ScheduledBatch()
        for seq in going:
            self.free_dead_blocks(seq)  # the device reads them in ``batch``, before the next step writes
            self.evict(seq)
            self.allocate(seq, 1)
            nxt.add(seq, 1, seq.take_dead_slots())
        return nxt

    def _schedule_running(self, batch: ScheduledBatch, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            threads = self.running[i].threads()
            for seq in threads:
                if budget <= 0:
                    batch.budget_ran_out = True
                    break
                n = self._schedule_thread(batch, seq, budget)
                if n is None:  # its request was preempted: it was the last one running
                    return budget
                budget -= n
            i += len(threads)
        if i < len(self.running):
            batch.budget_ran_out = True
        return budget

    def _schedule_thread(self, batch: ScheduledBatch, seq: Sequence, budget: int) -> int | None:
        """Schedule what ``seq`` may compute now, preempting later requests for blocks; the tokens scheduled,
        or None when ``seq``'s own request had to be preempted."""
        self.evict(seq)
        want = min(seq.ready_tokens(batch), budget)
        if want == 0:
            return 0
        n = self._fit(seq, want)
        while n == 0 and self.running[-1].request_id != seq.request_id:
            self._preempt(self.running[-1])
            n = self._fit(seq, want)
        if n == 0:
            if self.running[0].request_id == seq.request_id:
                raise RuntimeError(
                    f"the KV pool ({self.blocks.num_blocks} blocks) cannot hold request {seq.request_id} alone "
                    f"at {seq.num_computed} tokens; raise num_blocks / kv_cache_gb or use a bounded KV policy")
            self._preempt(seq, batch)
            return None
        self.allocate(seq, n)
        batch.add(seq, n, seq.take_dead_slots())
        return n

    def _admit_waiting(self, batch: ScheduledBatch, budget: int) -> None:
        while self.waiting and budget > 0 and self.can_admit(self.waiting[0]):
            seq = self.waiting[0]
            want = min(seq.ready_tokens(batch), budget)
            n = self._fit(seq, want, reserve=self._admission_reserve())
            assert n == want or not self.admit_by_bound, "the pool less the running bounds holds any chunk of a bound"
            if n == 0:
                break
            self.waiting.popleft()
            for thread in seq.threads():
                thread.status = Status.RUNNING
                self.running.append(thread)
            self.allocate(seq, n)
            batch.add(seq, n, seq.take_dead_slots())
            budget -= n

    def add_thread(self, seq: Sequence) -> None:
        """A new sequence of a running request (a Pasta fork): it runs beside the request's others."""
        last = max(i for i, s in enumerate(self.running) if s.request_id == seq.request_id)
        self.running.insert(last + 1, seq)
        seq.status = Status.RUNNING

    def _admission_reserve(self) -> int:
        """Free blocks an admission must leave: none under a bounded policy (the bounds reserve them);
        otherwise one per running sequence for its next decode plus, while any runs, the watermark."""
        if self.admit_by_bound or not self.running:
            return 0
        return len(self.running) + self.watermark_blocks

    def _fit(self, seq: Sequence, n: int, reserve: int = 0) -> int:
        """The most of the next ``n`` tokens whose blocks can be allocated now."""
        return seq.fit(n, max(0, self.blocks.num_free - reserve))

    def allocate(self, seq: Sequence, n: int) -> None:
        """Blocks for the next ``n`` tokens of ``seq`` (the caller checked that the pool has them)."""
        for j in seq.new_columns(n):
            seq.add_block(j, self.blocks.allocate())
        assert len(seq.blocks) <= seq.block_bound, (seq.request_id, len(seq.blocks), seq.block_bound)
        seq.kv.peak_blocks = max(seq.kv.peak_blocks, seq.held_blocks)

    def _preempt(self, seq: Sequence, batch: ScheduledBatch | None = None) -> None:
        """Preempt ``seq``'s whole request (all its threads; their rows leave ``batch``)."""
        assert not self.admit_by_bound, f"request {seq.request_id} was admitted by its bound yet needs preempting"
        for thread in seq.threads():
            self.running.remove(thread)
            for block in thread.reset_for_recompute():
                self.blocks.free(block)
        if batch is not None:
            batch.drop_request(seq.request_id)
        self.waiting.appendleft(seq.main)
        self.num_preemptions += 1

    def evict(self, seq: Sequence) -> None:
        """h2o: before allocating the decode step at ``seq.num_computed`` (never one already launched), drop
        the pages its budget cannot keep (``Sequence.evict_heavy_hitters``)."""
        if seq.heavy is not None and seq.num_computed >= seq.prompt_len:
            for block in seq.evict_heavy_hitters():
                self.blocks.free(block)

    def free_dead_blocks(self, seq: Sequence) -> None:
        for block in seq.pop_dead_blocks():
            self.blocks.free(block)

    def finish(self, seq: Sequence) -> None:
        """``seq``'s request is done: every thread leaves and lets go of its blocks."""
        for thread in seq.threads():
            self.running.remove(thread)
            for block in thread.release_blocks():
                self.blocks.free(block)
            thread.status = Status.FINISHED
