"""A trace as the learner trains it: its checks, and its training windows and rows under its KV policy.

``TraceWindows`` cuts a trace into the windows ``trainer.windows`` defines under the trace's own (bound) policy
— the whole trace with its Pasta or Planned Diffusion layout, truncated windows, or one window per segment of
a restart trace (``trainer.restarts``) — and keeps those with a loss token as ``algorithms.Row``s beside their
packable ``logprobs.WindowInput``. ``check_trace`` refuses a trace the learner cannot train, naming the bad
value. The ``Learner`` binds each trace's policy (it owns the vocabulary) and calls both.
"""

from __future__ import annotations

import math

import torch

from sliderl.core.kv_policy import KVPolicy
from sliderl.core.pasta import PastaLayout, PastaTokenIds
from sliderl.core.planned_diffusion import NoisedLayout, PDLayout, PDTokenIds, SpanNoise
from sliderl.core.restart import segments
from sliderl.core.trace import Trace
from sliderl.trainer.algorithms import Algorithm, Row
from sliderl.trainer.learner_args import LearnerArgs
from sliderl.trainer.logprobs import WindowInput
from sliderl.trainer.restarts import segment_windows
from sliderl.trainer.windows import training_windows

WINDOWED_KINDS = ("prefix_sliding", "sliding_window", "streaming")


class TraceWindows:
    """Training windows and rows of traces for one learner (its window settings, tokenizer and algorithm)."""

    def __init__(self, args: LearnerArgs, tokenizer, algorithm: Algorithm):
        self.args, self.tokenizer, self.algorithm = args, tokenizer, algorithm
        self._pasta_tags: PastaTokenIds | None = None  # looked up at the first pasta trace
        self._pd_tokens: PDTokenIds | None = None  # looked up at the first planned_diffusion trace
        self.noise: torch.Generator | None = None  # this step's span noise (None while evaluating: t = 1)

    def rows(self, index: int, trace: Trace, policy: KVPolicy, advantage: float = 0.0, role: str = "",
             group_size: int = 0) -> list[tuple[Row, WindowInput]]:
        """The trace's training windows under ``policy`` (its own, bound), those with a loss token, as (row, input)."""
        if not trace.completion_token_ids:
            return []
        forced = trace.forced or [False] * len(trace.completion_token_ids)
        sampler = torch.tensor(trace.logprobs, dtype=torch.float32) if trace.logprobs else None
        out = []
        for item, offset in self.windows(trace, policy):
            w = item.window
            mask = item.loss_mask(forced[offset:offset + w.num_generated])
            if mask.any():
                # a planned_diffusion trace's diffusion targets have no sampler logprob
                aligned = sampler is not None and item.num_targets == w.num_targets
                behaviour = sampler[offset + w.target_start:offset + w.target_end] if aligned else None
                noise_t = item.layout.noise.t if isinstance(item.layout, NoisedLayout) else 1.0
                out.append((Row(index, advantage, role, mask, behaviour, group_size=group_size,
                                target_kind=item.target_kind(), noise_t=noise_t), item))
        return out

    def windows(self, trace: Trace, policy: KVPolicy) -> list[tuple[WindowInput, int]]:
        """The trace's windows, each with the completion index of its window's first generated token: the whole
        trace's windows (offset 0), or one per segment of a restart trace (``trainer.restarts``)."""
        prompt_len, num_generated = len(trace.prompt_token_ids), len(trace.completion_token_ids)
        if policy.restarts:
            tail = self.args.window if self.args.window_mode == "truncated" else None
            return [(w.item, w.offset) for w in segment_windows(trace.prompt_token_ids, trace.completion_token_ids,
                                                                trace.restarts, trace.temperature, tail)]
        layout = {"pasta": self._pasta_layout, "planned_diffusion": self._pd_layout}.get(policy.kind,
                                                                                       lambda _: None)(trace)
        window = self.args.window or (policy.window if policy.kind in WINDOWED_KINDS else None)
        windows = training_windows(self.args.window_mode, prompt_len, num_generated, window, self.args.multiplier)
        ids = torch.tensor([*trace.prompt_token_ids, *trace.completion_token_ids], dtype=torch.int64)
        death = policy.death_positions(prompt_len, ids, trace.death_ranges)  # h2o: the engine's evictions too
        return [(WindowInput(ids, death, w, trace.temperature, layout), 0) for w in windows]

    def _pd_layout(self, trace: Trace) -> NoisedLayout:
        """The spans of a planned_diffusion trace with this step's noise draw (t = 1 while evaluating)."""
        self._whole_trace_only(trace, "planned_diffusion")
        if not self.algorithm.trains_spans:
            raise ValueError(f"trace {trace.trace_id!r} has KV policy planned_diffusion, whose spans train with the "
                             f"hybrid objective only: learner.algo.type must be planned_diffusion, got "
                             f"{self.algorithm.name}")
        if self._pd_tokens is None:
            self._pd_tokens = PDTokenIds.from_tokenizer(self.tokenizer)
        layout = PDLayout.parse(len(trace.prompt_token_ids), trace.completion_token_ids, self._pd_tokens,
                                self.tokenizer.decode, trace.forced)
        t = None if self.noise is not None else 1.0
        noise = SpanNoise.draw(layout, self.noise or torch.Generator().manual_seed(0), t)
        return NoisedLayout(layout, noise, self._pd_tokens.mask)

    def _whole_trace_only(self, trace: Trace, kind: str) -> None:
        if self.args.window_mode != "full":
            raise ValueError(f"trace {trace.trace_id!r} has KV policy {kind}, which trains on the whole trace only "
                             f"(its {'forks' if kind == 'pasta' else 'spans'}' keys and position ids span it): "
                             f"window_mode={self.args.window_mode!r} is not valid for it; set window_mode='full'")

    def _pasta_layout(self, trace: Trace) -> PastaLayout:
        """The threads of a pasta trace; they span the whole trace, so it trains only with window_mode 'full'."""
        self._whole_trace_only(trace, "pasta")
        if self._pasta_tags is None:
            self._pasta_tags = PastaTokenIds.from_tokenizer(self.tokenizer)
        return PastaLayout.parse(len(trace.prompt_token_ids), trace.completion_token_ids, self._pasta_tags,
                                 self.tokenizer.decode, trace.forced)


def check_trace(trace: Trace, policy: KVPolicy, vocab_size: int, algorithm: Algorithm) -> None:
    """Refuse a trace the learner cannot train, naming what is wrong with it and what would be valid."""
    name, n = f"trace {trace.trace_id!r}", len(trace.completion_token_ids)
    check_restarts(name, trace, policy)
    if not trace.prompt_token_ids:
        raise ValueError(f"{name} has an empty prompt; a trace needs at least one prompt token")
    sft_data = not trace.logprobs and not algorithm.needs_sampler_logprobs
    if len(trace.logprobs) != n and not sft_data:
        raise ValueError(f"{name} has {len(trace.logprobs)} sampler logprobs for {n} completion tokens"
                         + ("" if trace.logprobs else f" ({algorithm.name} needs the sampler's; only sft "
                                                      "trains on traces without them)"))
    if trace.forced and len(trace.forced) != n:
        raise ValueError(f"{name} has {len(trace.forced)} forced flags for {n} completion tokens")
    length = len(trace.prompt_token_ids) + n
    for start, end, death in trace.death_ranges:  # raises unless (start, end, death) triples
        if not 0 <= start < end <= length or death < end:
            raise ValueError(f"{name} has the kv_deaths range ({start}, {end}, {death}), which does not fit its "
                             f"{length} positions (need 0 <= start < end <= {length} and death >= end)")
    if not all(math.isfinite(x) for x in trace.logprobs):
        raise ValueError(f"{name} has non-finite sampler logprobs")
    vocab = vocab_size
    tails = [t for r in trace.restarts for t in r.context_tail]
    bad = [t for t in (*trace.prompt_token_ids, *trace.completion_token_ids, *tails) if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"{name} has token id {bad[0]} outside the vocabulary [0, {vocab})")
    if not (trace.temperature >= 0 and math.isfinite(trace.temperature)):
        raise ValueError(f"{name} has temperature {trace.temperature}; it must be a finite number >= 0")

def check_restarts(name: str, trace: Trace, policy: KVPolicy) -> None:
    """A restart trace's restarts fit it (in order, inside it, keeping at most its prompt); no other has any."""
    if not policy.restarts:
        if trace.restarts:
            raise ValueError(f"{name} has {len(trace.restarts)} restarts but KV policy {trace.kv_policy!r}, "
                             "which never restarts (only last_k and summary do)")
        return
    try:
        segments(trace.prompt_token_ids, len(trace.completion_token_ids), trace.restarts)
    except ValueError as err:
        raise ValueError(f"{name}: {err}") from None
    for r in trace.restarts:
        if not 0 <= r.kept_prompt <= len(trace.prompt_token_ids) or not r.kept_prompt + len(r.context_tail):
            raise ValueError(f"{name} has a restart at {r.at} keeping {r.kept_prompt} prompt tokens and "
                             f"{len(r.context_tail)} more: it must keep 0..{len(trace.prompt_token_ids)} of the "
                             "prompt and leave a non-empty context")
