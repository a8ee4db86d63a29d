"""Planned Diffusion as tokens: what the engine's runtime and the learner agree on (thesis, Planned Diffusion
chapter, and the published method it is cut from).

A response plans autoregressively, then writes the planned spans in parallel by discrete diffusion. It is one
*flattened* token sequence, the layout the runtime outputs and the learner reads:

    ... text ... <promise topic="A" tokens="5"/><promise topic="B" tokens="4"/>        the plan (autoregressive)
    <async> x x x ... <null> <null> </async><async> y y ... </async>                  the spans (diffusion)
    <sync/> ... text ... (plan, spans, sync again) ... eos                           autoregression resumes

The grammar reuses Pasta-Lang's tags (``core.pasta``): a plan item is a promise, ``<promise`` attribute text
``/>``, its ``tokens="N"`` the span's predicted length in UNITs; a span is wrapped in ``<async>`` ``</async>``;
``<sync/>`` ends the round. What differs, and why:

- **Where the sync stands and who writes what.** A *plan* is a run of consecutive promises. The model ends it by
  sampling ``<sync/>`` right after a promise's ``/>`` ("execute the plan"): the runtime then puts the spans
  *before* that ``<sync/>``, so in the flattened layout the ``<sync/>`` is the first token after the spans and,
  seeing them all, predicts the continuation. Like Pasta's promise ``/>`` that predicts the first main-thread
  token after its block, the ``<sync/>`` is predicted by the plan's last ``/>``. The span tags are the runtime's
  (forced, never targets); every autoregressive token, the ``<sync/>`` included, is the model's.
- **``tokens="N"`` counts the span's body**: the runtime's *scaffold* gives span k exactly ``UNIT · N_k`` body
  positions, each ``<mask>``, between ``<async>`` and ``</async>`` (Pasta's N counts a block with its tags).
  So position ids are the flattened indices: spans laid out by their predicted lengths, back to back, leave
  no gap and no overlap.
- **Two new tokens.** ``<mask>`` is the absorbing state of the diffusion (added to the vocabulary like the
  register tokens; it never appears in an output). ``<null>`` fills a body's positions past its content: the
  plan fixes a span's length to a multiple of 10, its content rarely is one, and a dedicated filler keeps eos
  meaning "end of response" (a body is content, then ``<null>`` to its end).

``PD_TOKENS`` are the tags plus ``<mask>`` and ``<null>``: special tokens of every tokenizer that runs PD.

Visibility (DESIGN.md, "Planned Diffusion spans"). Plan and text tokens see what precedes them (causal); a span
token sees the context, the plan through its own promise, and every token of its own span in both directions,
never another span; the ``<sync/>`` and everything after it see everything before. "Through its own promise":
span k sees plan items 1..k, so its own item is the last it sees and says which chunk it writes — seeing the
whole plan, every span of a round sees the same tokens and could tell itself from the others only by its
position ids (measured: a miniature trained that way copied the wrong chain into most of its spans, 3 of 78
right; ``docs/results.md``, "Planned Diffusion"). A span's keys are written at once (the runtime writes a finished
span's KV in one forward), so as a rule by comparisons, the form a FlexAttention ``mask_mod`` evaluates:

    q sees k  iff  write_at[k] <= write_at[q]
                   and  core.pasta.thread_visible(span[q], view_at[q], span[k], exposed_at[k])

``span`` is 0 on autoregressive tokens and s >= 1 on the s-th span's tokens (its tags included); ``write_at`` is a
token's own index, or its span's first index for a span token; ``exposed_at[k]`` is where k becomes visible
outside its span: k itself for an autoregressive token, its round's ``<sync/>`` for a span token (``NEVER``
when none came); ``view_at[q]`` is where q's view of autoregressive tokens stops: q itself, or for a span token
its promise's ``/>`` (the plan's last ``/>`` for a span past the plan's items). This is Pasta's thread rule with
one more reading of "thread" (a fork, too, sees the main thread up to its promise's ``/>``).

Training (``SpanNoise``, ``diffusion_stream``): one forward serves both objectives. The clean response is the
input of the autoregressive loss (each autoregressive token predicted by the previous one; spans are keys to
what follows their sync, with the KV the runtime commits); a noised copy of every span is appended — its
body tokens replaced by ``<mask>`` with probability t, t ~ U(0, 1) per sequence — at the same position ids,
seeing what its span sees (the context, the plan through its promise) and itself only. The masked positions
predict the clean tokens (the absorbing-state ELBO, weighted 1/t: ``trainer.losses.planned_diffusion_loss``).

Malformed pieces read as plain autoregressive tokens, counted in ``PDMalformed``: a ``<promise`` not closed by
``/>``; a plan not followed by its spans (with forced flags: by a forced ``<async>``) — its promises are plain
text; a tag that means nothing where it stands (one count per token; a ``<sync/>`` outside a round is an
ordinary token, not counted); a round whose span count or a span whose body length differs from its plan; a
round not closed by ``<sync/>`` (its spans are never exposed). A promise without a valid ``tokens="N"`` plans
``DEFAULT_PROMISE_UNITS``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import astuple, dataclass

import torch
from torch import Tensor

from sliderl.core.kv_policy import NEVER
from sliderl.core.pasta import (DEFAULT_PROMISE_UNITS, PASTA_TOKENS, UNIT, parse_input, promise_units,
                                thread_visible)

MASK = "<mask>"
NULL = "<null>"
PD_TOKENS = (*PASTA_TOKENS, MASK, NULL)
MIN_NOISE = 1e-3  # t is drawn from U(MIN_NOISE, 1): the 1/t weight stays finite


@dataclass(frozen=True)
class PDTokenIds:
    """The seven PD token ids of one tokenizer (``PD_TOKENS`` order)."""

    promise_open: int
    tag_close: int
    async_open: int
    async_close: int
    sync: int
    mask: int
    null: int

    @classmethod
    def from_tokenizer(cls, tokenizer) -> PDTokenIds:
        """Look the tokens up; a tokenizer without them is an error naming the missing ones."""
        vocab = tokenizer.get_vocab()
        missing = [t for t in PD_TOKENS if t not in vocab]
        if missing:
            raise ValueError(f"tokenizer has no Planned Diffusion tokens {missing}; add {list(PD_TOKENS)} as special "
                             "tokens (sliderl.core.vocab.bind_policy_vocab('planned_diffusion', tokenizer, model))")
        return cls(*(vocab[t] for t in PD_TOKENS))

    @property
    def tags(self) -> frozenset[int]:
        """The five structural tags."""
        return frozenset((self.promise_open, self.tag_close, self.async_open, self.async_close, self.sync))


@dataclass(frozen=True)
class Round:
    """One plan and its spans, in flattened indices (prompt first)."""

    plan: tuple[tuple[int, int], ...]  # [start, end) of each ``<promise … />``
    units: tuple[int, ...]  # each plan item's predicted body length, in UNITs
    spans: tuple[tuple[int, int], ...]  # [start, end) of each ``<async> … </async>`` (end = text's end if unclosed)
    sync: int | None  # index of the ``<sync/>`` that ends the round; None when none does

    def view(self, k: int) -> int:
        """The last autoregressive index span k (0-based) sees: its promise's ``/>`` (the plan's last for a span
        past the plan's items)."""
        return self.plan[k][1] - 1 if k < len(self.plan) else self.spans[0][0] - 1


@dataclass(frozen=True)
class PDMalformed:
    """How many pieces of a response break the grammar, by kind (module docstring, last paragraph)."""

    stray_tags: int = 0
    unclosed_promises: int = 0
    plans_without_spans: int = 0  # plans (of one or more promises) not followed by their spans: plain text
    promises_without_units: int = 0
    span_count_mismatches: int = 0  # rounds with more or fewer spans than plan items
    span_length_mismatches: int = 0  # spans whose body is not UNIT·N tokens
    unsynced_rounds: int = 0

    @property
    def total(self) -> int:
        return sum(astuple(self))


@dataclass(frozen=True)
class PDLayout:
    """Rounds, span membership and visibility of one flattened response (module docstring).

    Built by ``PDLayout.parse``; per-token tensors are int64 ``[P + T]`` over the prompt then the completion.
    Position ids (RoPE) are the flattened indices.
    """

    prompt_len: int
    span: Tensor  # 0 on autoregressive tokens, s >= 1 on the s-th span's tokens (tags included)
    rounds: tuple[Round, ...]
    malformed: PDMalformed

    @classmethod
    def parse(cls, prompt_len: int, completion_ids: Sequence[int] | Tensor, tags: PDTokenIds,
              decode: Callable[[list[int]], str], forced: Sequence[bool] | None = None) -> PDLayout:
        """Read ``completion_ids`` after a prompt of ``prompt_len`` tokens, in one pass.

        decode: token ids -> text, for each promise's ``tokens="N"``. forced: the runtime's forced flags of the
        completion (``RequestOutput.forced``); given (non-empty), only a forced ``<async>`` opens a span (the
        runtime's); None or empty: SFT text, any ``<async>`` right after a plan does.
        """
        ids, flags = parse_input(prompt_len, completion_ids, forced)
        return _Parser(prompt_len, ids, tags, decode, flags).run()

    def __len__(self) -> int:
        return self.span.shape[0]

    @property
    def num_generated(self) -> int:
        return len(self) - self.prompt_len

    @property
    def num_spans(self) -> int:
        return int(self.span.max()) if len(self) else 0

    @property
    def positions(self) -> Tensor:
        """RoPE position ids: the flattened indices (spans occupy exactly their planned lengths)."""
        return torch.arange(len(self))

    def spans(self) -> list[tuple[int, int, Round, int]]:
        """Every span as ``(start, end, its round, its view)`` in order (span s is the s-th, 1-based); its view is
        the last autoregressive index it sees (``Round.view``)."""
        return [(a, b, r, r.view(k)) for r in self.rounds for k, (a, b) in enumerate(r.spans)]

    def write_at(self) -> Tensor:
        """``[P + T]``: each token's index, or its span's first index for a span token."""
        out = torch.arange(len(self))
        for a, b, _, _ in self.spans():
            out[a:b] = a
        return out

    def exposed_at(self) -> Tensor:
        """``[P + T]``: where each key becomes visible outside its span (itself; a span token: its round's sync)."""
        out = torch.arange(len(self))
        for a, b, r, _ in self.spans():
            out[a:b] = NEVER if r.sync is None else r.sync
        return out

    def view_at(self) -> Tensor:
        """``[P + T]``: the last autoregressive index each query sees (itself; a span token: its promise's ``/>``)."""
        out = torch.arange(len(self))
        for a, b, _, view in self.spans():
            out[a:b] = view
        return out

    def mask_mod(self):
        """The rule as a FlexAttention ``mask_mod(b, h, q_idx, kv_idx)`` over flattened indices."""
        span, write, exposed, view = self.span, self.write_at(), self.exposed_at(), self.view_at()

        def visible(b, h, q_idx, kv_idx):
            return (write[kv_idx] <= write[q_idx]) & thread_visible(span[q_idx], view[q_idx], span[kv_idx],
                                                                   exposed[kv_idx])

        return visible

    def dense_mask(self) -> Tensor:
        """``[P + T, P + T]`` bool, True where query row i sees key column j, from what each token may see: the
        autoregressive table grows token by token and takes a round's spans at its sync; a span sees the table
        as its round began up to its promise, and all of itself."""
        n = len(self)
        mask = torch.zeros(n, n, dtype=torch.bool)
        table = torch.zeros(n, dtype=torch.bool)  # keys an autoregressive query sees so far
        starts = {a: (a, b, view) for a, b, _, view in self.spans()}
        syncs = {r.sync: r for r in self.rounds if r.sync is not None}
        i = 0
        while i < n:
            if i in starts:
                a, b, view = starts[i]
                mask[a:b, :view + 1] = table[:view + 1]
                mask[a:b, a:b] = True
                i = b
                continue
            for a, b in syncs.get(i, Round((), (), (), None)).spans:
                table[a:b] = True
            table[i] = True
            mask[i] = table
            i += 1
        return mask

    def ar_target_mask(self) -> Tensor:
        """``[T]`` bool: the completion's autoregressive tokens (False on span tokens, their tags included)."""
        return self.span[self.prompt_len:] == 0

    def body_mask(self) -> Tensor:
        """``[P + T]`` bool: span body tokens (the diffusion's targets), not their tags."""
        out = torch.zeros(len(self), dtype=torch.bool)
        for a, b, _, _ in self.spans():
            out[a + 1:b - 1] = True
        return out

    def predictor_index(self) -> Tensor:
        """``[T]``: for each completion token, the flattened index whose logits predict it autoregressively —
        the previous autoregressive token (a round's ``<sync/>``: its plan's last ``/>``); a span token's own
        index (it is no autoregressive target)."""
        last, out = self.prompt_len - 1, []
        for i, s in enumerate(self.span.tolist()[self.prompt_len:], start=self.prompt_len):
            out.append(i if s else last)
            last = last if s else i
        return torch.tensor(out, dtype=torch.int64)

    def sequential_forwards(self, steps_ratio: float) -> int:
        """Forward passes of the completion in sequence with ``steps_ratio`` denoising steps per span token and no
        confidence threshold: one per autoregressive token, and per round the slowest span's steps plus the one
        forward that commits the spans' KV (``rollout.planned_diffusion``)."""
        n = int(self.ar_target_mask().sum())
        for r in self.rounds:
            n += 1 + max(denoising_steps(b - a - 2, steps_ratio) for a, b in r.spans)
        return n


def denoising_steps(length: int, steps_ratio: float) -> int:
    """Steps a span of ``length`` body tokens takes at ``steps_ratio`` steps per token: ``ceil(ratio · length)``,
    at least 1 and at most ``length`` (one token a step at most)."""
    if length <= 0:
        return 0
    return max(1, min(length, math.ceil(steps_ratio * length - 1e-9)))


# ---------------------------------------------------------------- training: noise and the two-objective stream


@dataclass(frozen=True)
class SpanNoise:
    """One draw of the forward process for a response: every body token is masked with probability ``t``."""

    t: float
    masked: Tensor  # [P + T] bool, True on body tokens replaced by <mask>

    @classmethod
    def draw(cls, layout: PDLayout, generator: torch.Generator, t: float | None = None) -> SpanNoise:
        """t ~ U(MIN_NOISE, 1) (or the given ``t``), then each body token masked with probability t."""
        if t is None:
            t = MIN_NOISE + (1 - MIN_NOISE) * float(torch.rand((), generator=generator))
        if not 0 < t <= 1:
            raise ValueError(f"noise level t must be in (0, 1], got {t}")
        u = torch.rand(len(layout), generator=generator)
        return cls(t, layout.body_mask() & (u < t))


@dataclass(frozen=True)
class DiffusionStream:
    """One response as the learner's input: its clean tokens (inputs ``[0, P + T - 1)``), then a noised copy of
    every span. All ``[N]`` int64 except where noted."""

    input_ids: Tensor
    positions: Tensor  # RoPE
    write_at: Tensor
    span: Tensor  # a copy of span s is span s + num_spans
    exposed_at: Tensor
    view_at: Tensor
    predictor_index: Tensor  # [T + M] stream index scoring each target: the completion, then the copies' bodies
    target_ids: Tensor  # [T + M]
    target_kind: Tensor  # [T + M] int8: 0 autoregressive, 1 a span body token kept, 2 one masked (a diffusion target)


AR_TARGET, KEPT_TARGET, MASKED_TARGET = 0, 1, 2


@dataclass(frozen=True)
class NoisedLayout:
    """A response's layout with one noise draw: what the learner trains on (``diffusion_stream``)."""

    layout: PDLayout
    noise: SpanNoise
    mask_id: int

    def __len__(self) -> int:
        return len(self.layout)

    @property
    def prompt_len(self) -> int:
        return self.layout.prompt_len

    @property
    def num_copied(self) -> int:
        """Stream tokens after the clean response: every span's tokens once more."""
        return sum(b - a for a, b, _, _ in self.layout.spans())

    @property
    def num_body(self) -> int:
        """Span body tokens: the diffusion targets."""
        return int(self.layout.body_mask().sum())

    def stream(self, token_ids: Tensor) -> DiffusionStream:
        return diffusion_stream(self.layout, token_ids, self.noise, self.mask_id)


def diffusion_stream(layout: PDLayout, token_ids: Tensor, noise: SpanNoise, mask_id: int) -> DiffusionStream:
    """The clean response and its noised spans as one stream (module docstring). ``token_ids``: ``[P + T]``."""
    n, p = len(layout), layout.prompt_len
    if token_ids.shape != (n,) or noise.masked.shape != (n,):
        raise ValueError(f"layout is for {n} tokens, got token_ids {tuple(token_ids.shape)} and noise "
                         f"{tuple(noise.masked.shape)}")
    clean = torch.arange(n - 1)
    write, exposed, view = layout.write_at(), layout.exposed_at(), layout.view_at()
    parts = [(clean, layout.span[clean], exposed[clean], view[clean])]
    copies = [torch.arange(a, b) for a, b, _, _ in layout.spans()]
    copy = torch.cat(copies) if copies else torch.zeros(0, dtype=torch.int64)
    parts.append((copy, layout.span[copy] + layout.num_spans, torch.full_like(copy, NEVER), view[copy]))
    order = torch.cat([clean, copy])
    ids = token_ids[order].clone()
    ids[n - 1:] = torch.where(noise.masked[copy], torch.full_like(copy, mask_id), token_ids[copy])
    body = layout.body_mask()[copy]
    kind = torch.where(noise.masked[copy], MASKED_TARGET, KEPT_TARGET)[body]
    return DiffusionStream(
        input_ids=ids, positions=order.clone(), write_at=write[order],
        span=torch.cat([parts[0][1], parts[1][1]]), exposed_at=torch.cat([parts[0][2], parts[1][2]]),
        view_at=torch.cat([parts[0][3], parts[1][3]]),
        predictor_index=torch.cat([layout.predictor_index().clamp(max=n - 2), n - 1 + body.nonzero()[:, 0]]),
        target_ids=torch.cat([token_ids[p:], token_ids[copy][body]]),
        target_kind=torch.cat([torch.zeros(n - p, dtype=torch.int8), kind.to(torch.int8)]),
    )


class _Parser:
    """One pass over a completion for ``PDLayout.parse`` (module docstring)."""

    def __init__(self, prompt_len: int, ids: list[int], tags: PDTokenIds, decode: Callable[[list[int]], str],
                 forced: list[bool] | None):
        self.p, self.ids, self.tags, self.decode, self.forced = prompt_len, ids, tags, decode, forced
        self.span = [0] * (prompt_len + len(ids))
        self.rounds: list[Round] = []
        self.counts = dict.fromkeys(PDMalformed.__dataclass_fields__, 0)
        self.tag_start: int | None = None  # index of an open <promise
        self.plan: list[tuple[int, int, int]] = []  # complete promises of the current plan: (start, end, units)
        self.spans: list[list[int]] | None = None  # the round being read: [start, end] per span (end -1: open)
        self.num_spans = 0

    def run(self) -> PDLayout:
        for j, tok in enumerate(self.ids):
            i = self.p + j
            if self.spans is not None and self._round_token(i, tok):
                continue
            self._ar_token(i, tok)
        self._end()
        return PDLayout(self.p, torch.tensor(self.span, dtype=torch.int64), tuple(self.rounds),
                        PDMalformed(**self.counts))

    def _opens_span(self, i: int, tok: int) -> bool:
        return tok == self.tags.async_open and (self.forced is None or self.forced[i - self.p])

    def _round_token(self, i: int, tok: int) -> bool:
        """A token while a round is read; False when it ends the round and is an autoregressive token."""
        spans, t = self.spans, self.tags
        if spans and spans[-1][1] < 0:  # inside a span: its tokens up to </async>
            self.span[i] = self.num_spans
            if tok == t.async_close:
                spans[-1][1] = i + 1
            elif tok in t.tags:
                self.counts["stray_tags"] += 1
            return True
        if self._opens_span(i, tok):
            self.num_spans += 1
            self.span[i] = self.num_spans
            spans.append([i, -1])
            return True
        self._close_round(i if tok == t.sync else None)
        return tok == t.sync

    def _close_round(self, sync: int | None) -> None:
        spans = [(a, b if b >= 0 else self.p + len(self.ids)) for a, b in self.spans]
        units = tuple(u for _, _, u in self.plan)
        self.counts["span_count_mismatches"] += len(spans) != len(units)
        self.counts["span_length_mismatches"] += sum(b - a - 2 != UNIT * u for (a, b), u in zip(spans, units))
        self.counts["unsynced_rounds"] += sync is None
        self.rounds.append(Round(tuple((a, b) for a, b, _ in self.plan), units, tuple(spans), sync))
        self.plan, self.spans = [], None

    def _ar_token(self, i: int, tok: int) -> None:
        t = self.tags
        if self.tag_start is not None:
            if tok not in t.tags:  # the promise's attribute text
                return
            start, self.tag_start = self.tag_start, None
            if tok == t.tag_close:
                units = promise_units(self.decode(self.ids[start - self.p + 1:i - self.p]))
                self.counts["promises_without_units"] += units is None
                self.plan.append((start, i + 1, DEFAULT_PROMISE_UNITS if units is None else units))
                return
            self.counts["unclosed_promises"] += 1
            self._drop_plan()
        if self.plan and self.plan[-1][1] == i:  # right after a plan item's />
            if tok == t.promise_open:
                self.tag_start = i
                return
            if self._opens_span(i, tok):
                self.spans = []
                self._round_token(i, tok)
                return
            self._drop_plan()
        if tok == t.promise_open:
            self.tag_start = i
        elif tok in t.tags and tok != t.sync:
            self.counts["stray_tags"] += 1

    def _drop_plan(self) -> None:
        if self.plan:
            self.counts["plans_without_spans"] += 1
        self.plan = []

    def _end(self) -> None:
        if self.spans is not None:
            self._close_round(None)
        self.counts["unclosed_promises"] += self.tag_start is not None
        self._drop_plan()
