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
from dataclasses import replace

import torch

from sliderl.core.pasta import DEFAULT_PROMISE_UNITS, UNIT, PastaTokenIds, promise_units
from sliderl.rollout.mode import DecodingMode, EngineContext, TokenSteps
from sliderl.rollout.pasta.records import ForkSpan, PastaOutput, PastaRequestOutput
from sliderl.rollout.pasta.request import Join, PastaPool, PastaRequest, PastaThread
from sliderl.rollout.sampling import SamplingParams
from sliderl.rollout.scheduler import ScheduledBatch


class PastaRuntime(DecodingMode):
    """The decoding mode of ``kv="pasta"``: acts on the tags of every request of one engine (module docstring).

    ``args.pasta_max_forks`` caps the forks per request; a promise's attributes are decoded with the
    engine's tokenizer, and the engine's eos ids close a fork.
    """

    name = "pasta"

    def __init__(self, context: EngineContext, args):
        super().__init__(context, args)
        self.tags = tags = PastaTokenIds.from_tokenizer(context.tokenizer)
        self.tag_ids = {tags.promise_open, tags.tag_close, tags.async_open, tags.async_close, tags.sync}
        self.max_forks = args.pasta_max_forks
        self.scheduler = context.scheduler
        self.decode = context.tokenizer.decode
        self.eos_ids = context.eos_ids
        self.block_size = context.block_size
        self.max_model_len = context.max_model_len
        self.pool = PastaPool(context.policy, context.scheduler.blocks, context.block_size, context.max_model_len,
                              context.max_chunk, self.max_forks)

    # ---- the seam ---------------------------------------------------------------------------------
    def new_request(self, request_id: int, prompt: list[int], params: SamplingParams, seed: int,
                    arrival: float) -> PastaThread:
        """A request's main thread (the ``Sequence`` that stands for it)."""
        return PastaRequest(self.pool, request_id, prompt, params, seed, arrival).main

    def block_bound(self, prompt_len: int, max_tokens: int) -> int:
        return self.pool.block_bound(prompt_len, max_tokens)

    def smaller_request(self) -> str:
        return f"max_tokens, the prompt or pasta_max_forks={self.max_forks}"

    def check_thread(self, thread: int) -> None:
        if isinstance(thread, bool) or not isinstance(thread, int) or thread < 0:
            raise ValueError(f"thread must be 0 or a fork's index k >= 1, got {thread!r}")

    def take(self, post: TokenSteps, seq: PastaThread, token: int, logprob: float, logits: torch.Tensor) -> bool:
        """The main thread takes its token as any sequence does, then the runtime reads it; a fork's token goes
        to the runtime. A request finishes in ``end_step``, once every thread is done."""
        if seq.index == 0:
            post.append(seq, token, logprob, logits)
            self.main_token(seq, post.stops(seq))
        else:
            self.fork_token(seq, token, logprob)
        return False

    def output(self, post: TokenSteps, seq: PastaThread) -> PastaRequestOutput:
        """The flattened response; its text is cut where the main thread's is (it ends with the main thread's
        last tokens)."""
        text = post.text(seq, seq.output_token_ids)
        ids, logprobs, forced, pasta = self.flatten(seq)
        cut = len(post.text(seq, seq.output_token_ids, cut=False)) - len(text)
        flat = post.text(seq, ids, cut=False)
        return PastaRequestOutput(seq.request_id, seq.prompt_token_ids, ids, logprobs, flat[:len(flat) - cut],
                                  seq.finish_reason, seq.kv, forced, seq.num_preemptions,
                                  seq.finished_at - seq.arrival, pasta=pasta)

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
        fork.settle(fork.num_computed if fork.request.main.stopped else len(fork.token_ids))

    def _stop_main(self, request: PastaRequest) -> None:
        main = request.main
        main.stopped, main.kv_target = True, main.num_computed
        request.changes += 1
        for fork in request.unjoined:  # no join will read them
            if fork.stopped:
                fork.settle(min(fork.kv_target, fork.num_computed))

    # ---- steps and outputs ------------------------------------------------------------------------
    def end_step(self, batch: ScheduledBatch, finished: list[PastaThread]) -> list[PastaThread]:
        """Count the step for every request in ``batch``; finish those done; their main threads."""
        finished = []
        for request in {id(s.request): s.request for s in batch.seqs}.values():
            request.steps += 1
            if request.done:
                self.scheduler.finish(request.main)
                request.main.kv.mean_visible_tokens = request.visible_sum / max(request.num_queries, 1)
                request.main.kv.token_steps = request.visible_sum
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
