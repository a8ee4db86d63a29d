"""One thread of a Pasta request inside the engine: a ``Sequence`` whose tokens are placed in its block table
by segments, so that attention's ``k <= q`` holds in *table order* while RoPE sees the Pasta position ids.

A thread's ``token_ids`` read as a sequence: the main thread's are the prompt and its own tokens; a fork's
are its main thread's up to the promise's ``/>`` (its prompt: that KV is the main thread's, shared by
reference count), then ``<async>`` and its own. ``segments`` say where each token goes: token ``i`` of the
segment ``(first, at, rope)`` (the last segment with ``first <= i``) sits at slot ``at + i - first`` of the
table (block column · block_size + offset) and gets RoPE position ``rope + i - first``. A new segment
starts at a fresh block whenever the thread's table changes: at a promise (both threads) and at a join
(after the joined forks' blocks). The rest of the block a thread leaves is a *hole* (``holes``): its
slots' deaths are written 0 (``take_dead_slots``, before the next forward) so no query sees them.

``rollout.pasta.runtime`` creates threads and moves them between segments; this module only places tokens.
"""

from __future__ import annotations

from bisect import bisect_right
from typing import TYPE_CHECKING

from sliderl.core.kv_policy import NEVER
from sliderl.rollout.sampling import SamplingParams
from sliderl.rollout.sequence import Sequence, Status

if TYPE_CHECKING:
    from sliderl.rollout.pasta.runtime import PastaRequest
    from sliderl.rollout.scheduler import ScheduledBatch


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
                         request.runtime.policy.tracker(len(prompt_token_ids)), request.runtime.block_size, arrival,
                         max_model_len=request.runtime.max_model_len, max_chunk=request.runtime.max_chunk)
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
        self.request.runtime.blocks.share(block)

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
