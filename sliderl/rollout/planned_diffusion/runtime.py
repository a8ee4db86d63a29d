"""Planned Diffusion's runtime: the decoding mode of ``kv="planned_diffusion"`` (``rollout.mode``).

The grammar, the layout and the visibility rule are ``core.planned_diffusion``'s. Per request:

- **Plan.** The request decodes autoregressively as any sequence (the engine's steps, CUDA graphs and all),
  the runtime following its promises (``PDSequence.read_token``). A ``<sync/>`` sampled right after a plan's
  last ``/>`` executes the plan; anything else after a ``/>`` leaves the plan as plain text.
- **Scaffold.** The ``<sync/>`` moves back: in front of it go, per plan item, ``<async>``, ``UNIT · N`` ``<mask>``
  and ``</async>``. A plan whose scaffold and one more token would pass ``max_tokens`` or ``max_model_len`` ends
  the request (finish reason ``length``; counted in ``PDCounts.plans_over_length``).
- **Parallel diffusion.** While its round denoises the request asks the scheduler for nothing. After every
  engine step (``end_step``) the runtime takes one denoising step of every such request at once: one forward over
  the tokens of every span still masked, each span attending to its request's cached context and plan through its
  own promise and to itself in both directions (``span_attention``); the logits at every masked position give a
  draw (the request's temperature, top-k and top-p; ``<mask>`` and the tags excluded), its entropy and its
  confidence, and each span reveals the positions its knobs choose (``unmasking``). When nothing else could run
  (every running request denoises, no admission waits) it goes on stepping, so batch-1 latency does not wait for
  empty engine steps.
- **Commit and sync.** A round whose spans are all revealed takes one more forward over its clean spans that
  writes their K/V into the pool at their slots (blocks reserved by the request's bound: ``planned_diffusion``
  admits by bound and is never preempted, since a recompute by prefill could not redo a span's KV). Then the
  ``<sync/>`` is the request's next uncomputed token: the engine's next step computes it over everything before,
  spans included, and autoregression goes on, planning again or not, until eos.

Draws are counter-based (``rollout.sampling``): a request draws the same tokens whatever shares its batch. A
denoising forward's shape changes every step (the requests denoising, their spans, their prefixes), so it runs
padded up to a bucket and, on CUDA, as a graph captured on the bucket's first use and replayed after
(``span_graphs``; on CPU the padded forward runs eagerly). Eager, a denoising forward of the 1.7B shape took
29-36 ms on the H200 against 2.5 ms for a graph-replayed decode step (docs/results.md, "Planned Diffusion").
Under ``cuda_graphs=False`` denoising forwards run eagerly at their exact shape; commit forwards always do.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from sliderl.core.logprob import scaled_logits
from sliderl.core.planned_diffusion import PDTokenIds
from sliderl.rollout.mode import DecodingMode, EngineContext, TokenSteps
from sliderl.rollout.planned_diffusion.records import PDOutput, PDRequestOutput
from sliderl.rollout.planned_diffusion.request import PDSequence
from sliderl.rollout.planned_diffusion.span_attention import SpanAttention, SpanBatch
from sliderl.rollout.planned_diffusion.span_graphs import SpanGraphs
from sliderl.rollout.planned_diffusion.unmasking import DenoisingKnobs, choose_reveals, reveal
from sliderl.rollout.sampling import SamplingParams, sample, uniform_noise
from sliderl.rollout.scheduler import ScheduledBatch

DRAW_STEPS = 1 << 31  # a denoising draw's sampler step lies in [2^31, 2^32): never an autoregressive token's index


@dataclass
class DenoisingStats:
    """The runtime's own forwards over an engine's life."""

    denoising_forwards: int = 0
    commit_forwards: int = 0
    span_tokens_in: int = 0  # tokens fed to denoising forwards
    seconds: float = 0.0  # wall time of the denoising and commit steps (host and device)


class PDRuntime(DecodingMode):
    """The decoding mode of ``kv="planned_diffusion"`` (module docstring); ``args.pd_*`` are its knobs."""

    name = "planned_diffusion"

    def __init__(self, context: EngineContext, args):
        super().__init__(context, args)
        if context.runner is None:
            raise ValueError("the planned_diffusion mode runs forwards of its own: its EngineContext needs the runner")
        self.tags = tags = PDTokenIds.from_tokenizer(context.tokenizer)
        self.knobs = DenoisingKnobs(args.pd_steps_ratio, args.pd_confidence, args.pd_order)
        self.scheduler = context.scheduler
        self.runner = context.runner
        self.banned = sorted(tags.tags | {tags.mask})  # a span body holds content and <null> only
        self.diffusing: list[PDSequence] = []
        self.stats = DenoisingStats()
        self.graphs = SpanGraphs(self.runner) if args.cuda_graphs else None  # denoising forwards in buckets

    # ---- the seam ---------------------------------------------------------------------------------
    def new_request(self, request_id: int, prompt: list[int], params: SamplingParams, seed: int,
                    arrival: float) -> PDSequence:
        c = self.context
        return PDSequence(request_id, prompt, params, seed, c.policy.tracker(len(prompt)), c.block_size, arrival,
                          max_model_len=c.max_model_len, max_chunk=c.max_chunk, tags=self.tags,
                          decode=c.tokenizer.decode)

    def take(self, post: TokenSteps, seq: PDSequence, token: int, logprob: float, logits: torch.Tensor) -> bool:
        """The token is appended as any sequence's; a ``<sync/>`` that executes a plan starts a round instead of
        stopping anything."""
        post.append(seq, token, logprob, logits)
        if seq.read_token():
            if seq.scaffold_fits(min(seq.prompt_len + seq.params.max_tokens, self.context.max_model_len - 1)):
                seq.start_round(self.knobs)
                self.diffusing.append(seq)
                return False
            seq.counts.plans_over_length += 1
            seq.finish_reason = "length"
            post.finish(seq)
            return True
        if post.stops(seq):
            post.finish(seq)
            return True
        return False

    def end_step(self, batch: ScheduledBatch, finished: list[PDSequence]) -> list[PDSequence]:
        """Count the step for its requests; one denoising step of every round (more while nothing else runs)."""
        for seq in {id(s): s for s in batch.seqs}.values():
            seq.engine_steps += 1
        while self.diffusing:
            self.denoise_step()
            if self._others_ready():
                break
        return finished

    def output(self, post: TokenSteps, seq: PDSequence) -> PDRequestOutput:
        out = seq.output_token_ids
        text = post.text(seq, [t for t in out if t != self.tags.null])
        body = sum(b - a - 2 for r in seq.rounds for a, b in r.spans)
        pd = PDOutput(list(seq.rounds), seq.engine_steps + seq.denoising_forwards + seq.commit_forwards,
                      seq.denoising_forwards, seq.commit_forwards, seq.num_output - seq.inserted, body, seq.counts)
        return PDRequestOutput(seq.request_id, seq.prompt_token_ids, out, seq.logprobs, text, seq.finish_reason, seq.kv,
                               seq.forced, seq.num_preemptions, seq.finished_at - seq.arrival, list(seq.kv_deaths),
                               planned_diffusion=pd)

    # ---- denoising ----------------------------------------------------------------------------------
    def _others_ready(self) -> bool:
        """Whether the next engine step has work: a running request not denoising, or an admission."""
        s = self.scheduler
        return any(seq.round is None for seq in s.running) or bool(s.waiting and s.can_admit(s.waiting[0]))

    @torch.inference_mode()
    def denoise_step(self) -> None:
        """One forward over the masked spans of every round being denoised; each span reveals what its knobs
        choose; rounds now fully revealed are committed."""
        t0 = time.perf_counter()
        seqs, ids, pos, prefixes, span_ids, views, rows, where = list(self.diffusing), [], [], [], [], [], [], []
        for seq in seqs:
            r, spans, seen = seq.round, [], []
            for k, span in enumerate(r.spans):
                if span.done:
                    continue
                a, b = r.span_ranges[k]
                masked = set(span.masked)
                for p in range(a, b):
                    if p in masked:
                        rows.append(len(ids))
                        where.append((seq, span, p))
                    ids.append(seq.token_ids[p])
                    pos.append(p)
                    spans.append(k)
                    seen.append(r.views[k])
            prefixes.append(self._prefix_slots(seq))
            span_ids.append(spans)
            views.append(seen)
        logits = self._forward(ids, pos, prefixes, span_ids, views, rows)
        tokens, logprobs, priority, confidence = self._draw(logits, where)
        self._reveal(where, tokens, logprobs, priority, confidence)
        self.stats.denoising_forwards += 1
        self.stats.span_tokens_in += len(ids)
        done = [seq for seq in seqs if seq.round.done]
        if done:
            self._commit(done)
        self.stats.seconds += time.perf_counter() - t0

    def _prefix_slots(self, seq: PDSequence) -> list[int]:
        """Pool slots of the request's cached positions (everything before its round); once per round."""
        r, bs = seq.round, seq.block_size
        if r.prefix_slots is None:
            r.prefix_slots = [seq.blocks[p // bs] * bs + p % bs for p in range(r.start)]
        return r.prefix_slots

    def _forward(self, ids: list[int], pos: list[int], prefixes: list[list[int]], span_ids: list[list[int]],
                 views: list[list[int]], rows: list[int] | None, writes: list[int] | None = None) -> torch.Tensor | None:
        """The model over the span tokens (the layout as ``SpanBatch.build`` takes it); logits ``[len(rows), V]`` at
        ``rows``, or for a commit (``rows`` None) none, the K/V written at ``writes``. A denoising forward runs
        padded to a bucket (``self.graphs``, unless ``cuda_graphs`` is off), a commit eagerly at its exact shape."""
        if rows is not None and self.graphs is not None:
            return self.graphs.logits(ids, pos, prefixes, span_ids, views, rows)
        runner = self.runner
        dev, host = runner.device, runner.host_tensor
        attn = SpanAttention(runner.cache, SpanBatch.build(prefixes, span_ids, views, dev, writes), runner.scale)
        hidden = runner.model(host(ids, torch.long).to(dev, non_blocking=True),
                              host(pos, torch.long).to(dev, non_blocking=True), attn)
        if rows is None:
            return None
        return runner.model.compute_logits(hidden[host(rows, torch.long).to(dev, non_blocking=True)])

    def _draw(self, logits: torch.Tensor, where: list) -> tuple[list, ...]:
        """Per masked position: its draw, the draw's logprob, its ordering key and its confidence (host lists)."""
        dev, host = logits.device, self.runner.host_tensor
        col = lambda values, dtype: host(values, dtype).to(dev, non_blocking=True)  # noqa: E731
        params = [seq.params for seq, _, _ in where]
        logits[:, self.banned] = float("-inf")
        temperature = col([p.temperature for p in params], torch.float32)
        seed = col([seq.seed for seq, _, _ in where], torch.int64)
        step = col([self._draw_step(seq, p) for seq, _, p in where], torch.int64)
        tokens, logprobs = sample(logits, temperature, col([p.top_p for p in params], torch.float32),
                                  col([p.top_k for p in params], torch.int64), seed, step,
                                  all_greedy=all(p.temperature <= 0 for p in params),
                                  any_truncation=any(p.top_k > 0 or p.top_p < 1 for p in params))
        probs = torch.softmax(scaled_logits(logits, temperature), dim=-1)
        confidence = probs.max(dim=-1).values
        if self.knobs.order == "entropy":
            priority = torch.special.entr(probs).sum(dim=-1)
        else:
            priority = uniform_noise(seed, step ^ (1 << 30), 1)[:, 0]
        return tuple(t.tolist() for t in (tokens, logprobs, priority, confidence))

    @staticmethod
    def _draw_step(seq: PDSequence, position: int) -> int:
        """The sampler step of a draw: unique per (round, denoising step, position) of the request."""
        r = seq.round
        return DRAW_STEPS + ((r.index * 4099 + r.steps) * 8191 + position - r.start) % DRAW_STEPS

    def _reveal(self, where: list, tokens: list, logprobs: list, priority: list, confidence: list) -> None:
        by_span: dict[int, list[int]] = {}
        for i, (_, span, _) in enumerate(where):
            by_span.setdefault(id(span), []).append(i)
        for rows in by_span.values():
            seq, span, _ = where[rows[0]]
            chosen = set(choose_reveals(span, [priority[i] for i in rows], [confidence[i] for i in rows], self.knobs))
            for i in rows:
                p = where[i][2]
                if p in chosen:
                    seq.token_ids[p] = tokens[i]
                    seq.logprobs[p - seq.prompt_len] = logprobs[i]
            reveal(span, sorted(chosen))
        for seq in {id(w[0]): w[0] for w in where}.values():
            seq.round.steps += 1
            seq.denoising_forwards += 1

    def _commit(self, seqs: list[PDSequence]) -> None:
        """One forward over the finished rounds' clean spans, writing their K/V into the pool."""
        ids, pos, prefixes, span_ids, views, writes = [], [], [], [], [], []
        for seq in seqs:
            r, bs = seq.round, seq.block_size
            self.scheduler.allocate(seq, r.end - r.start)
            ids += seq.token_ids[r.start:r.end]
            pos += range(r.start, r.end)
            prefixes.append(self._prefix_slots(seq))
            span_ids.append(r.span_ids())
            views.append(r.token_views())
            writes += [seq.blocks[p // bs] * bs + p % bs for p in range(r.start, r.end)]
        self._forward(ids, pos, prefixes, span_ids, views, None, writes)
        self.stats.commit_forwards += 1
        for seq in seqs:
            seq.mark_computed(seq.round.end - seq.round.start)
            seq.commit_forwards += 1
            seq.end_round()
            self.diffusing.remove(seq)
