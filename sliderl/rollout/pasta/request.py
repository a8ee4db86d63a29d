"""A Pasta request inside the engine: its threads, its forks' joins, and how each thread places its tokens.

``PastaRequest`` answers the scheduler's questions about the request (which threads run, how many tokens each
may compute, when a fork attaches and a join happens). Each thread is a ``PastaThread``: a ``Sequence`` whose
tokens are placed in its block table by segments, so that attention's ``k <= q`` holds in *table order* while
RoPE sees the Pasta position ids.

A thread's ``token_ids`` read as a sequence: the main thread's are the prompt and its own tokens; a fork's
are its main thread's up to the promise's ``/>`` (its prompt: that KV is the main thread's, shared by
reference count), then ``<async>`` and its own. ``segments`` say where each token goes: token ``i`` of the
segment ``(first, at, rope)`` (the last segment with ``first <= i``) sits at slot ``at + i - first`` of the
table (block column · block_size + offset) and gets RoPE position ``rope + i - first``. A new segment
starts at a fresh block whenever the thread's table changes: at a promise (both threads) and at a join
(after the joined forks' blocks). The rest of the block a thread leaves is a *hole* (``holes``): its
slots' deaths are written 0 (``take_dead_slots``, before the next forward) so no query sees them.

``rollout.pasta.runtime`` reads the tags, creates forks and moves threads between segments.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass

from sliderl.core.kv_policy import NEVER, KVPolicy
from sliderl.rollout.block_bound import kv_positions
from sliderl.rollout.block_manager import BlockManager
from sliderl.rollout.pasta.records import PastaCounts
from sliderl.rollout.sampling import SamplingParams
from sliderl.rollout.scheduler import ScheduledBatch
from sliderl.rollout.sequence import Sequence, Status


@dataclass(frozen=True)
class PastaPool:
    """The engine's pool and sizes that a Pasta request works in."""

    policy: KVPolicy
    blocks: BlockManager
    block_size: int
    max_model_len: int
    max_chunk: int  # the longest prefill chunk
    max_forks: int

    def block_bound(self, prompt_len: int, max_tokens: int) -> int:
        """The most blocks a request holds: its threads never free a block; the main thread holds its prompt and
        tokens, starting a fresh block at each promise that forks and at each ``<sync/>`` that joins (at most
        ``2 * max_forks`` part-filled blocks), and each fork its own blocks of at most ``max_tokens`` sampled
        tokens plus ``<async>`` and ``</async>``; the shared prefix counts once."""
        return pasta_block_bound(prompt_len, max_tokens, self.max_model_len, self.block_size, self.max_forks)


def pasta_block_bound(prompt_len: int, max_tokens: int, max_model_len: int, block_size: int, max_forks: int) -> int:
    """``PastaPool.block_bound`` from the sizes alone."""
    end = kv_positions(prompt_len, max_tokens, max_model_len)
    fork = -(-min(max_tokens + 2, max_model_len) // block_size)
    return -(-end // block_size) + max_forks * (2 + fork)


@dataclass
class Join:
    """A ``<sync/>`` of the main thread and the forks it joins."""

    index: int  # the ``<sync/>``'s token index on the main thread
    forks: list[PastaThread]
    first_column: int | None = None  # the main table's column of the first joined block, once joined
    done: bool = False  # joined in the current blocks (a preemption undoes it)

class PastaRequest:
    """The threads of one request, its forks' joins and its counters; the scheduler's questions about them."""

    def __init__(self, pool: PastaPool, request_id: int, prompt: list[int], params: SamplingParams, seed: int,
                 arrival: float):
        self.pool = pool
        self.request_id = request_id
        self.block_bound = pool.block_bound(len(prompt), params.max_tokens)
        self.forks: list[PastaThread] = []
        self.joins: list[Join] = []
        self.unjoined: list[PastaThread] = []
        self.tag_start: int | None = None  # main-thread index of a ``<promise`` whose ``/>`` has not come
        self.counts = PastaCounts()
        self.steps = 0
        self.changes = self.changes_scheduled = 0  # changes to its threads (fork, fork end, join, stop); scheduled
        self.held_blocks = 0  # distinct blocks its threads hold
        self.visible_sum = self.num_queries = 0
        self.main = PastaThread(self, 0, prompt, params, seed, [(0, 0, 0)], arrival)

    def note_query(self, keys_visible: int) -> None:
        self.visible_sum += keys_visible
        self.num_queries += 1

    def schedule_order(self) -> list[PastaThread]:
        """The main thread first (a fork attaches behind it), last while it waits at a join (the forks'
        last ``</async>`` is written in the same step). A step schedules the request: its changes so far are in it."""
        self.changes_scheduled = self.changes
        join = self._pending_join()
        if join is not None and self.main.num_computed == join.index:
            return [*self.forks, self.main]
        return [self.main, *self.forks]

    def _pending_join(self) -> Join | None:
        return next((j for j in self.joins if not j.done), None)

    def ready_tokens(self, thread: PastaThread, batch: ScheduledBatch) -> int:
        """How many tokens ``thread`` may compute in ``batch``: a fork once its main thread's ``/>`` is
        written (or being written in ``batch``), the main thread up to its next join, which waits for the
        joined forks to be written whole (in ``batch`` or before)."""
        if thread is self.main:
            return self._main_ready(batch)
        if not thread.attached:
            if thread.kv_end == 0 or self.main.num_computed + batch.tokens_of(self.main) <= thread.fork_point:
                return 0
            self._attach(thread)
        return max(0, thread.kv_end - thread.num_computed)

    def _main_ready(self, batch: ScheduledBatch) -> int:
        main = self.main
        join = self._pending_join()
        while join is not None and main.num_computed == join.index:
            if not all(f.stopped and f.num_computed + batch.tokens_of(f) >= len(f.token_ids) for f in join.forks):
                return 0
            self._join(join)
            join = self._pending_join()
        end = main.kv_end if join is None else min(main.kv_end, join.index)
        return end - main.num_computed

    def _attach(self, fork: PastaThread) -> None:
        """The fork's table starts as the main thread's up to the block of its ``/>``, with the holes in it."""
        for j in range(fork.fork_column + 1):
            fork.share_block(j, self.main.blocks[j])
        fork.inherit_holes(self.main, {j: j for j in range(fork.fork_column + 1)})
        fork.num_computed = fork.fork_point + 1
        fork.attached = True

    def _join(self, join: Join) -> None:
        """The joined forks' own blocks go after the main thread's, its ``<sync/>`` into a fresh block."""
        main, bs = self.main, self.pool.block_size
        if join.first_column is None:
            last = main.table_positions(join.index - 1, 1)[0]
            for j in [j for j in main.blocks if j > last // bs]:  # allocated ahead for the <sync/>'s old slot
                self.pool.blocks.free(main.remove_block(j))
                self.held_blocks -= 1
            main.leave_block(last)
            join.first_column = last // bs + 1
            width = sum(len(f.own_columns()) for f in join.forks)
            main.add_segment(join.index, (join.first_column + width) * bs, main.rope_positions(join.index, 1)[0])
            main.keys_visible += sum(f.num_output for f in join.forks)
        column = join.first_column
        for fork in join.forks:
            columns = {j: column + k for k, j in enumerate(fork.own_columns())}
            for j, c in columns.items():
                main.share_block(c, fork.blocks[j])
            main.inherit_holes(fork, columns)
            column += len(columns)
        join.done = True

    def reset(self) -> None:
        """Preempted: nothing is held, nothing joined."""
        self.held_blocks = 0
        for join in self.joins:
            join.done = False

    @property
    def done(self) -> bool:
        """Every thread stopped and written as far as needed."""
        return all(t.stopped and t.num_computed >= t.kv_target for t in (self.main, *self.forks))


class PastaThread(Sequence):
    """The main thread (``index`` 0) or the ``index``-th fork of a Pasta request (``request``).

    ``stopped``: the thread samples no more (the main thread at eos / a stop / its length; a fork once
    its ``</async>`` is in); a stopped thread still needs the KV of its first ``kv_target`` tokens (the
    main thread's last token is never written; a fork's block is written whole when a join will read it).
    A fork waits to be ``attached`` (given its prefix blocks) until its main thread writes its ``/>``.
    """

    def __init__(self, request: PastaRequest, index: int, prompt_token_ids: list[int], params: SamplingParams,
                 seed: int, segments: list[tuple[int, int, int]], arrival: float):
        super().__init__(request.request_id, prompt_token_ids, params, seed,
                         request.pool.policy.tracker(len(prompt_token_ids)), request.pool.block_size, arrival,
                         max_model_len=request.pool.max_model_len, max_chunk=request.pool.max_chunk)
        self.request = request
        self.index = index
        self.block_bound = request.block_bound
        self.segments = segments
        self._firsts = [s[0] for s in segments]
        self.stopped = False
        self.kv_target = 0
        self.attached = index == 0
        self.holes: list[tuple[int, int]] = []  # (table column, first unused offset) of blocks left part-filled
        self._holes_marked: set[int] = set()  # columns whose holes are dead in the current blocks
        self.keys_visible = len(prompt_token_ids)  # keys the query at the last token sees (itself included)
        self.fork_point = -1  # a fork's: token index of its promise's ``/>`` (the end of its prefix)
        self.fork_column = -1  # a fork's: the table column of that ``/>``, its last shared block
        self.promise_start = -1  # a fork's: token index of its ``<promise``
        self.units = 0  # a fork's predicted length, in UNITs
        self.closed_by = ""  # a fork's: "model", "stop" or "length" (``PastaOutput``)

    # ---- placement ------------------------------------------------------------------------------
    def _placed(self, start: int, n: int, field: int) -> list[int]:
        """``field`` 1 (table slot) or 2 (RoPE position) of tokens ``start .. start + n - 1``."""
        out, k, i, end = [], bisect_right(self._firsts, start) - 1, start, start + n
        while i < end:
            seg = self.segments[k]
            stop = min(end, self._firsts[k + 1]) if k + 1 < len(self._firsts) else end
            out.extend(range(seg[field] + i - seg[0], seg[field] + stop - seg[0]))
            i, k = stop, k + 1
        return out

    def table_positions(self, start: int, n: int) -> list[int]:
        return self._placed(start, n, 1)

    def rope_positions(self, start: int, n: int) -> list[int]:
        return self._placed(start, n, 2)

    @property
    def last_position(self) -> int:
        return self.rope_positions(len(self.token_ids) - 1, 1)[0]

    def add_segment(self, first: int, at: int, rope: int) -> None:
        """Tokens from index ``first`` on go to table slot ``at`` onwards with RoPE positions ``rope`` onwards
        (replacing the last segment when no token reached it: a ``<sync/>`` right after a promise)."""
        assert first >= self._firsts[-1] and at % self.block_size == 0, (first, at, self.segments)
        if first == self._firsts[-1]:
            self.segments.pop()
            self._firsts.pop()
        self.segments.append((first, at, rope))
        self._firsts.append(first)

    def leave_block(self, at: int) -> None:
        """The thread's tokens stop at table slot ``at``: the rest of that block is a hole."""
        hole = (at // self.block_size, at % self.block_size + 1)
        if hole[1] < self.block_size and hole not in self.holes:
            self.holes.append(hole)

    def inherit_holes(self, other: PastaThread, columns: dict[int, int]) -> None:
        """``other``'s blocks at its columns ``columns`` sit in this thread's table at ``columns[j]``: so do their
        holes, which this thread then marks dead too when it is scheduled first (with overlap, a fork may end,
        or a main thread may leave a block, in a step queued before it was known, so that the thread that left
        the hole is never scheduled to mark it)."""
        for j, offset in other.holes:
            hole = (columns[j], offset) if j in columns else None
            if hole is not None and hole not in self.holes:
                self.holes.append(hole)

    def own_columns(self) -> range:
        """A fork's own table columns (after its shared prefix), in order."""
        last = self.table_positions(len(self.token_ids) - 1, 1)[0] // self.block_size
        return range(self.fork_column + 1, last + 1)

    # ---- what the scheduler and the model runner ask ------------------------------------------
    def key_deaths(self, start: int, n: int) -> list[int]:
        return [NEVER] * n  # full visibility: a key dies only as a hole

    def ready_tokens(self, batch: ScheduledBatch) -> int:
        return self.request.ready_tokens(self, batch)

    @property
    def samples_on(self) -> bool:
        return not self.stopped  # a stopped thread's row writes its last KV; its sample is dropped

    @property
    def may_run_ahead(self) -> bool:
        return self.request.changes == self.request.changes_scheduled

    def stale_ahead(self) -> bool:
        """The main thread's queued row follows its last token (it samples no more: its request goes on while forks
        run), or computes a ``<sync/>`` that joins forks (it belongs after their blocks)."""
        return self.index == 0 and (self.stopped or any(not j.done and j.index == self.num_computed
                                                        for j in self.request.joins))

    @property
    def kv_end(self) -> int:
        """How many of the tokens need their KV: all while it runs, ``kv_target`` once stopped."""
        return self.kv_target if self.stopped else len(self.token_ids)

    def fit(self, n: int, free_blocks: int) -> int:
        count, new = 0, set()
        for at in self.table_positions(self.num_computed, n):
            j = at // self.block_size
            if j not in self.blocks and j not in new:
                if len(new) == free_blocks:
                    break
                new.add(j)
            count += 1
        return count

    def new_columns(self, n: int) -> list[int]:
        columns = dict.fromkeys(at // self.block_size for at in self.table_positions(self.num_computed, n))
        return [j for j in columns if j not in self.blocks]

    def take_dead_slots(self) -> list[int]:
        bs, dead = self.block_size, []
        for j, offset in self.holes:
            if j in self.blocks and j not in self._holes_marked:
                dead.extend(range(self.blocks[j] * bs + offset, (self.blocks[j] + 1) * bs))
                self._holes_marked.add(j)
        return dead

    @property
    def held_blocks(self) -> int:
        return self.request.held_blocks

    @property
    def thread_index(self) -> int:
        return self.index

    @property
    def tokens_taken(self) -> int:
        return self.num_output - (self.index > 0)  # a fork's <async> was inserted, not taken

    @property
    def main(self) -> PastaThread:
        return self.request.main

    def threads(self) -> list[PastaThread]:
        return self.request.schedule_order()

    # ---- blocks and tokens ----------------------------------------------------------------------
    def add_block(self, j: int, block: int) -> None:
        """A block allocated for this thread (the request holds one more)."""
        super().add_block(j, block)
        self.request.held_blocks += 1

    def share_block(self, j: int, block: int) -> None:
        """Another thread's block at column ``j`` of this thread's table (one more reference)."""
        super().add_block(j, block)
        self.request.pool.blocks.share(block)

    def block_completed(self, j: int) -> None:
        pass  # full visibility: no block dies while its request runs

    def append_token(self, token: int, logprob: float, forced: bool) -> list[tuple[int, int]]:
        """A token produced by this thread's last query (sampled, or put in its place by budget forcing)."""
        self.request.note_query(self.keys_visible)
        self.kv.peak_visible_tokens = max(self.kv.peak_visible_tokens, self.keys_visible)
        self._push(token, logprob, forced)
        return []

    def insert_tag(self, token: int) -> None:
        """A tag the runtime inserts (``<async>``, a closing ``</async>``): no query chose it, so it carries no
        logprob (0.0) and is marked forced."""
        self._push(token, 0.0, True)

    def _push(self, token: int, logprob: float, forced: bool) -> None:
        self.token_ids.append(token)
        self.logprobs.append(logprob)
        self.forced.append(forced)
        self.keys_visible += 1

    def settle(self, kv_target: int) -> None:
        """Stopped: it needs the KV of its first ``kv_target`` tokens; 0 when none of its own (a fork's prefix is
        the main thread's)."""
        self.kv_target = kv_target if kv_target > self.fork_point + 1 else 0

    def reset_for_recompute(self) -> list[int]:
        """Preemption (of the whole request): drop every block; tokens, segments and holes stay, so
        recomputing rebuilds the same tables (a fork waits to be attached again)."""
        self.num_computed = 0
        self.status = Status.WAITING
        self.attached = self.index == 0
        self._holes_marked.clear()
        if self.index == 0:
            self.num_preemptions += 1
            self.request.reset()
        return self.release_blocks()
