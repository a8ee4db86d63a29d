"""The Pasta-Lang runtime in the engine (``LLM(model, kv="pasta")``): forks at promises, joins at syncs.

What the runtime does (thesis, Pasta chapter; the tags are ``core.pasta``'s):

- **Fork.** When the main thread samples the ``/>`` that closes a ``<promise …`` tag, a fork starts: a new
  sequence (``PastaThread``) that shares the main thread's blocks up to that ``/>`` by reference count,
  gets ``<async>`` from the runtime (forced, logprob 0.0) and samples until ``</async>``. A fork that
  samples eos or a stop token, reaches ``max_tokens`` sampled tokens, or reaches ``max_model_len`` is
  closed by the runtime: ``</async>`` is appended after its last token (forced), and counted. Forks
  spawn from the main thread only: inside a fork ``<promise``, ``/>``, ``<async>`` and ``<sync/>`` are
  plain text. At most ``max_forks`` forks per request; a promise past it is plain text. The main thread
  goes on without seeing any fork. A fork samples with the request's parameters and its own seed
  (derived from the request's and its index); budget forcing and stop strings apply to the main
  thread only, eos and stop tokens close a fork.
- **Sync.** A ``<sync/>`` sampled by the main thread joins every fork not joined yet: the main thread
  is not scheduled until they have all ended, then their blocks join its table and its ``<sync/>`` is
  written (in the same step as the last fork's ``</async>``), so it and everything after see them. A
  ``<sync/>`` with no fork to join is plain text.
- **End.** A request finishes when its main thread has stopped (eos, stop, length) and every fork has
  ended; forks still running when the main thread stops run on. Its finish reason is the main thread's.
- **Malformed tags** read as plain text where they stand, counted in ``PastaCounts``: a ``<promise``
  interrupted by another tag (which then acts as itself), a ``/>``, ``<async>`` or ``</async>`` on the
  main thread outside a promise, a tag in a fork. A promise without a valid ``tokens="N"`` forks with
  ``DEFAULT_PROMISE_UNITS``. A ``/>`` on which the main thread stops, or that leaves no room for a
  fork under ``max_model_len``, forks nothing (and shifts no position), as one past ``max_forks``; an
  ``<async>`` the main thread samples right after it is plain text. ``core.pasta``'s parser reads
  the flattened response the same when given its forced flags (only the runtime's ``<async>`` forks).

Visibility by write order (DESIGN.md, "Pasta threads"). Each thread's block table lists exactly the keys
it may see, each before the queries that see it: at a promise both threads continue in fresh blocks
(the fork's table is the main thread's up to the ``/>``), at a sync the main thread appends its forks'
blocks, then continues in a fresh block; the rest of a block a thread leaves is dead (death 0). The
kernels' mask ``k <= q < death[k]`` then runs on table slots (``PastaThread.table_positions``); the Pasta
position ids feed RoPE only: the prompt has ``0 .. P-1``, main-thread tokens continue the main count, a
fork's ``<async>`` gets position(``/>``) + 1 and its tokens count on from there, and the main thread's
tokens after a promise are shifted past it by the predicted length ``UNIT · N``.

Scheduling. All threads of all requests share one pool and one forward; a request's threads run
together (``Scheduler``), the main thread first, or last while it waits at a sync, so that a fork
starts in the step that writes its ``/>`` and a join happens in the step that writes the last
``</async>``. Preemption takes the whole request: every thread drops its blocks and the request is
recomputed from its tokens, replaying the same forks and joins into the same table layout. A request's
block bound (``rollout.block_bound``) counts ``max_forks`` forks at full length and ``add_request``
refuses one that cannot fit the pool alone; any thread short of a block preempts the newest request,
so the oldest always progresses and a main thread waiting at a sync never starves its forks. With overlap
(a decode step queued before the last one's tokens are read, ``rollout.run_ahead``), a change to a request's
threads (``PastaRequest.changes``: a fork, a fork's end, a join, the main thread's stop) stops queueing its
steps ahead until a step schedules it, and the queued row of a joining ``<sync/>`` is dropped
(``PastaThread.stale_ahead``): outputs are the same, a fork starts and a join happens a step later.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

from sliderl.rollout.block_bound import block_bound
from sliderl.rollout.block_manager import BlockManager
from sliderl.core.kv_policy import KVPolicy
from sliderl.core.pasta import DEFAULT_PROMISE_UNITS, UNIT, PastaTokenIds, promise_units
from sliderl.rollout.pasta.thread import PastaThread
from sliderl.rollout.sampling import SamplingParams
from sliderl.rollout.scheduler import ScheduledBatch, Scheduler


@dataclass(frozen=True)
class ForkSpan:
    """One fork of a finished request, in flattened indices counting the prompt first (as ``core.pasta``)."""

    promise: tuple[int, int]  # [start, end) of ``<promise … />``; end - 1 is its ``/>``, the fork point
    block: tuple[int, int]  # [start, end) of ``<async> … </async>``
    join: int | None  # index of the ``<sync/>`` that joined it; None when the main thread never synced it
    units: int  # predicted length UNIT · units (DEFAULT_PROMISE_UNITS without a valid tokens="N")
    closed_by: str  # "model" (sampled </async>), "stop" (eos / a stop token), "length" (max_tokens / max_model_len)


@dataclass
class PastaCounts:
    """What the runtime read as plain text or repaired in one request."""

    unclosed_promises: int = 0  # ``<promise`` interrupted by another tag, or open when the main thread stopped
    promises_without_units: int = 0  # forked with DEFAULT_PROMISE_UNITS
    promises_over_limit: int = 0  # past max_forks: plain text
    promises_unforked: int = 0  # ``/>`` on which the main thread stopped, or without room under max_model_len
    promises_in_forks: int = 0  # ``<promise`` inside a fork: plain text
    stray_tags: int = 0  # main thread: ``/>``, ``<async>``, ``</async>`` outside a tag; a fork: ``/>``, ``<async>``
    forks_closed_by_runtime: int = 0  # ``</async>`` appended after eos / a stop token / the fork's limit


@dataclass
class PastaOutput:
    """A finished Pasta request's threads and speed (``RequestOutput.pasta``).

    ``steps`` is the realised critical path: the engine steps in which the request had a row in the
    batch (prefill chunks, decodes, a fork's last ``</async>`` written, recomputation after a
    preemption; with overlap, not a queued step whose only row was dropped). ``speedup`` = flattened
    response tokens (``RequestOutput.token_ids``, inserted tags included) / ``steps``: 1.0 for a response without forks decoded one token per step, more when
    forks decode beside the main thread.
    """

    forks: list[ForkSpan]
    steps: int
    speedup: float
    counts: PastaCounts


@dataclass
class Join:
    """A ``<sync/>`` of the main thread and the forks it joins."""

    index: int  # the ``<sync/>``'s token index on the main thread
    forks: list[PastaThread]
    first_column: int | None = None  # the main table's column of the first joined block, once joined
    done: bool = False  # joined in the current blocks (a preemption undoes it)


class PastaRequest:
    """The threads of one request, its forks' joins and its counters; the scheduler's questions about them."""

    def __init__(self, runtime: PastaRuntime, request_id: int, prompt: list[int], params: SamplingParams, seed: int,
                 arrival: float):
        self.runtime = runtime
        self.request_id = request_id
        self.block_bound = block_bound(runtime.policy, len(prompt), params.max_tokens, runtime.max_model_len,
                                       runtime.block_size, runtime.max_chunk, runtime.max_forks)
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
        main, bs = self.main, self.runtime.block_size
        if join.first_column is None:
            last = main.table_positions(join.index - 1, 1)[0]
            for j in [j for j in main.blocks if j > last // bs]:  # allocated ahead for the <sync/>'s old slot
                self.runtime.blocks.free(main.remove_block(j))
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


class PastaRuntime:
    """Acts on the tags of every request of one engine under ``kv="pasta"`` (module docstring).

    ``decode``: token ids -> text (a promise's attributes); ``eos_ids``: tokens that close a fork.
    """

    def __init__(self, tags: PastaTokenIds, max_forks: int, scheduler: Scheduler, policy: KVPolicy, decode,
                 eos_ids: set[int], *, block_size: int, max_model_len: int, max_chunk: int):
        self.tags = tags
        self.tag_ids = {tags.promise_open, tags.tag_close, tags.async_open, tags.async_close, tags.sync}
        self.max_forks = max_forks
        self.scheduler = scheduler
        self.blocks: BlockManager = scheduler.blocks
        self.policy = policy
        self.decode = decode
        self.eos_ids = eos_ids
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_chunk = max_chunk

    def new_request(self, request_id: int, prompt: list[int], params: SamplingParams, seed: int,
                    arrival: float) -> PastaThread:
        """A request's main thread (the ``Sequence`` that stands for it)."""
        return PastaRequest(self, request_id, prompt, params, seed, arrival).main

    # ---- tokens -----------------------------------------------------------------------------------
    def main_token(self, main: PastaThread, stopped: bool) -> None:
        """The main thread took its next token (sampled or budget-forced); ``stopped``: it was its last."""
        request, tags = main.request, self.tags
        i, token = len(main.token_ids) - 1, main.token_ids[-1]
        if stopped:
            self._stop_main(request)
        if request.tag_start is not None:
            if token not in self.tag_ids:  # the promise's attribute text
                return self._left_open(request, stopped)
            start, request.tag_start = request.tag_start, None
            if token == tags.tag_close:
                return self._promise(request, start, stopped)
            request.counts.unclosed_promises += 1
        if token == tags.promise_open:
            request.tag_start = i
            self._left_open(request, stopped)
        elif token == tags.sync:
            if request.unjoined and not stopped:
                request.joins.append(Join(i, request.unjoined))
                request.unjoined = []
                request.changes += 1
        elif token in self.tag_ids:
            request.counts.stray_tags += 1

    def _left_open(self, request: PastaRequest, stopped: bool) -> None:
        """A ``<promise`` is open: when the main thread stopped there, it is never closed."""
        if stopped:
            request.counts.unclosed_promises += 1

    def _promise(self, request: PastaRequest, start: int, stopped: bool) -> None:
        main = request.main
        if stopped or main.last_position > self.max_model_len - 3:  # a fork needs <async> and </async> to fit
            request.counts.promises_unforked += 1
        elif len(request.forks) >= self.max_forks:
            request.counts.promises_over_limit += 1
        else:
            units = promise_units(self.decode(main.token_ids[start + 1:-1]))
            if units is None:
                request.counts.promises_without_units += 1
            self._fork(request, start, DEFAULT_PROMISE_UNITS if units is None else units)

    def _fork(self, request: PastaRequest, start: int, units: int) -> None:
        """Fork at the main thread's last token (its ``/>``): both continue in fresh blocks."""
        main, bs = request.main, self.block_size
        point = len(main.token_ids) - 1
        at, rope = main.table_positions(point, 1)[0], main.rope_positions(point, 1)[0]
        main.leave_block(at)
        fresh = (at // bs + 1) * bs
        segments = [s for s in main.segments if s[0] <= point] + [(point + 1, fresh, rope + 1)]
        main.add_segment(point + 1, fresh, rope + 1 + UNIT * units)
        index = len(request.forks) + 1
        params = replace(main.params, max_thinking_tokens=None, stop=None)  # budget forcing and stop strings: main only
        fork = PastaThread(request, index, main.token_ids[:point + 1], params,
                           (main.seed * 1_000_003 + index) % 2**63, segments, main.arrival)
        fork.fork_point, fork.fork_column, fork.promise_start, fork.units = point, at // bs, start, units
        fork.kv = main.kv
        fork.keys_visible = main.keys_visible
        fork.insert_tag(self.tags.async_open)
        request.forks.append(fork)
        request.unjoined.append(fork)
        request.changes += 1
        self.scheduler.add_thread(fork)
        if fork.last_position >= self.max_model_len - 2:
            self._close(fork, "length")

    def fork_token(self, fork: PastaThread, token: int, logprob: float) -> None:
        """A fork sampled ``token`` (dropped when the fork has ended: its row only wrote its last KV)."""
        if fork.stopped:
            return
        fork.append_token(token, logprob, False)
        p, counts = fork.params, fork.request.counts
        if token == self.tags.async_close:
            return self._end_fork(fork, "model")
        counts.promises_in_forks += token == self.tags.promise_open
        counts.stray_tags += token in (self.tags.tag_close, self.tags.async_open)
        if (token in self.eos_ids and not p.ignore_eos) or token in p.stop_token_ids:
            self._close(fork, "stop")
        elif fork.num_output - 1 >= p.max_tokens or fork.last_position >= self.max_model_len - 2:
            self._close(fork, "length")

    def _close(self, fork: PastaThread, why: str) -> None:
        fork.insert_tag(self.tags.async_close)
        fork.request.counts.forks_closed_by_runtime += 1
        self._end_fork(fork, why)

    def _end_fork(self, fork: PastaThread, why: str) -> None:
        fork.stopped, fork.closed_by = True, why
        fork.request.changes += 1
        fork.leave_block(fork.table_positions(len(fork.token_ids) - 1, 1)[0])
        # a join will read the whole block; after the main thread stopped, nothing will
        _settle(fork, fork.num_computed if fork.request.main.stopped else len(fork.token_ids))

    def _stop_main(self, request: PastaRequest) -> None:
        main = request.main
        main.stopped, main.kv_target = True, main.num_computed
        request.changes += 1
        for fork in request.unjoined:  # no join will read them
            if fork.stopped:
                _settle(fork, min(fork.kv_target, fork.num_computed))

    # ---- steps and outputs ------------------------------------------------------------------------
    def end_step(self, batch: ScheduledBatch) -> list[PastaThread]:
        """Count the step for every request in ``batch``; finish those done; their main threads."""
        finished = []
        for request in {id(s.request): s.request for s in batch.seqs}.values():
            request.steps += 1
            if request.done:
                self.scheduler.finish(request.main)
                request.main.kv.mean_visible_tokens = request.visible_sum / max(request.num_queries, 1)
                request.main.finished_at = time.perf_counter()
                finished.append(request.main)
        return finished

    def flatten(self, main: PastaThread) -> tuple[list[int], list[float], list[bool], PastaOutput]:
        """The flattened response (each fork's block right after its promise), its logprobs and forced flags,
        and the request's ``PastaOutput``."""
        request, p = main.request, main.prompt_len
        ids, logprobs, forced = [], [], []

        def take(thread: PastaThread, k: int) -> None:  # the thread's k-th generated token
            ids.append(thread.output_token_ids[k])
            logprobs.append(thread.logprobs[k])
            forced.append(thread.forced[k])

        at_point = {fork.fork_point: fork for fork in request.forks}
        flat = {}  # main-thread index -> flattened index
        blocks = {}  # fork -> its block's flattened [start, end)
        for i in range(p, len(main.token_ids)):
            flat[i] = p + len(ids)
            take(main, i - p)
            fork = at_point.get(i)
            if fork is not None:
                for k in range(fork.num_output):
                    take(fork, k)
                blocks[fork] = (flat[i] + 1, p + len(ids))
        joined = {fork: flat[join.index] for join in request.joins for fork in join.forks}
        forks = [ForkSpan((flat[f.promise_start], flat[f.fork_point] + 1), blocks[f], joined.get(f), f.units,
                          f.closed_by) for f in request.forks]
        steps = max(request.steps, 1)
        return ids, logprobs, forced, PastaOutput(forks, request.steps, len(ids) / steps, request.counts)


def _settle(fork: PastaThread, kv_target: int) -> None:
    """A stopped fork needs the KV of its first ``kv_target`` tokens; 0 when none of its own (its prefix is
    the main thread's)."""
    fork.kv_target = kv_target if kv_target > fork.fork_point + 1 else 0
