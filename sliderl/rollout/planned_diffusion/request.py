"""A Planned Diffusion request inside the engine: one sequence that decodes autoregressively, plans, and holds
the round being denoised.

``PDSequence`` is a plain ``Sequence`` (its block table is its tokens in order: positions are indices) that also
follows its own plan (``read_token``), takes a round's scaffold in front of the ``<sync/>`` that executes it
(``start_round``), and asks the scheduler for nothing while that round denoises (``ready_tokens`` 0): the
runtime's own forwards write the spans' tokens, and their KV at the commit, after which the ``<sync/>`` is the
next token the engine computes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sliderl.core.kv_policy import NEVER
from sliderl.core.pasta import DEFAULT_PROMISE_UNITS, UNIT, promise_units
from sliderl.core.planned_diffusion import PDTokenIds
from sliderl.rollout.planned_diffusion.records import PDCounts, RoundSpans
from sliderl.rollout.planned_diffusion.unmasking import DenoisingKnobs, SpanState
from sliderl.rollout.sequence import Sequence


@dataclass
class DenoisingRound:
    """A round being denoised: its scaffold's token indices ``[start, end)`` (``end`` is the ``<sync/>``)."""

    index: int  # the request's round number (seeds its draws)
    plan_start: int
    start: int
    end: int
    spans: list[SpanState]
    steps: int = 0  # denoising forwards so far
    span_ranges: list[tuple[int, int]] = field(default_factory=list)  # [start, end) of each <async> … </async>
    views: list[int] = field(default_factory=list)  # each span's promise's />: the last cached position it sees
    prefix_slots: list[int] | None = None  # pool slots of positions 0 .. start - 1 (the runtime fills it once)

    @property
    def done(self) -> bool:
        return all(s.done for s in self.spans)

    def span_ids(self) -> list[int]:
        """The span index of each scaffold token, in order."""
        return [k for k, (a, b) in enumerate(self.span_ranges) for _ in range(a, b)]

    def token_views(self) -> list[int]:
        """The view (``views``) of each scaffold token, in order."""
        return [self.views[k] for k, (a, b) in enumerate(self.span_ranges) for _ in range(a, b)]


class PDSequence(Sequence):
    """A request under ``kv="planned_diffusion"`` (module docstring). ``tags``: the tokenizer's PD ids;
    ``decode``: ids -> text, for a promise's ``tokens="N"``."""

    def __init__(self, *args, tags: PDTokenIds, decode, **kwargs):
        super().__init__(*args, **kwargs)
        self.tags = tags
        self.decode = decode
        self.tag_start: int | None = None  # token index of an open <promise
        self.plan: list[tuple[int, int, int]] = []  # (start, its />, units) of the current plan's promises
        self.plan_end = -1  # token index right after the plan's last />
        self.round: DenoisingRound | None = None
        self.rounds: list[RoundSpans] = []
        self.counts = PDCounts()
        self.engine_steps = self.denoising_forwards = self.commit_forwards = 0
        self.inserted = 0  # scaffold tokens (tags and bodies): not taken by the autoregressive script

    # ---- what the scheduler asks ---------------------------------------------------------------
    def ready_tokens(self, batch) -> int:
        return 0 if self.round is not None else self.num_uncomputed

    @property
    def may_run_ahead(self) -> bool:
        """Not while a promise is open or a plan waits: its next token may execute the plan (a scaffold then goes
        before it), nor while a round denoises."""
        return self.tag_start is None and not self.plan and self.round is None

    @property
    def tokens_taken(self) -> int:
        return self.num_output - self.inserted

    def key_deaths(self, start: int, n: int) -> list[int]:
        return [NEVER] * n

    def block_completed(self, j: int) -> None:
        pass  # full visibility: no block dies while its request runs

    def append_token(self, token: int, logprob: float, forced: bool) -> list[tuple[int, int]]:
        """A token its last query produced; that query saw every earlier token (no death tracking: nothing dies)."""
        self.visible_sum += len(self.token_ids)
        self.kv.peak_visible_tokens = max(self.kv.peak_visible_tokens, len(self.token_ids))
        self._push(token, logprob, forced)
        return []

    # ---- the plan ------------------------------------------------------------------------------
    def read_token(self) -> bool:
        """Follow the grammar over the token just appended; True when it is the ``<sync/>`` that executes a plan
        (``core.planned_diffusion``: a run of promises, then ``<sync/>`` right after the last ``/>``)."""
        t, i = self.tags, len(self.token_ids) - 1
        tok = self.token_ids[i]
        if self.tag_start is not None:
            if tok not in t.tags:  # the promise's attribute text
                return False
            start, self.tag_start = self.tag_start, None
            if tok == t.tag_close:
                units = promise_units(self.decode(self.token_ids[start + 1:i]))
                self.counts.promises_without_units += units is None
                self.plan.append((start, i, DEFAULT_PROMISE_UNITS if units is None else units))
                self.plan_end = i + 1
                return False
            self.counts.unclosed_promises += 1
            self.drop_plan()
        if self.plan and self.plan_end == i:
            if tok == t.promise_open:
                self.tag_start = i
                return False
            if tok == t.sync:
                return True
            self.drop_plan()
        if tok == t.promise_open:
            self.tag_start = i
        elif tok in t.tags and tok != t.sync:
            self.counts.stray_tags += 1
        return False

    def drop_plan(self) -> None:
        if self.plan:
            self.counts.plans_without_spans += 1
        self.plan = []

    def scaffold_fits(self, limit: int) -> bool:
        """Whether the plan's scaffold and one token after the ``<sync/>`` stay within ``limit`` tokens."""
        extra = sum(UNIT * units + 2 for _, _, units in self.plan)
        return len(self.token_ids) + extra + 1 <= limit

    def start_round(self, knobs: DenoisingKnobs) -> DenoisingRound:
        """The scaffold goes in front of the ``<sync/>`` just sampled: per plan item ``<async>``, ``UNIT · N``
        ``<mask>``, ``</async>`` (tags forced, logprob 0.0). The round it starts."""
        assert self.num_computed == len(self.token_ids) - 1, "the <sync/> is the only token not computed"
        t = self.tags
        sync, logprob, forced = self.token_ids.pop(), self.logprobs.pop(), self.forced.pop()
        start = len(self.token_ids)
        ranges, spans = [], []
        for _, _, units in self.plan:
            a = len(self.token_ids)
            body = [t.mask] * (UNIT * units)
            for token in (t.async_open, *body, t.async_close):
                self._push(token, 0.0, token != t.mask)
            ranges.append((a, len(self.token_ids)))
            spans.append(SpanState.scaffold(a + 1, len(body), knobs))
        self.inserted += len(self.token_ids) - start
        self._push(sync, logprob, forced)
        plan_start = self.plan[0][0]
        self.round = DenoisingRound(len(self.rounds), plan_start, start, len(self.token_ids) - 1, spans,
                                    span_ranges=ranges, views=[view for _, view, _ in self.plan])
        self.plan = []
        return self.round

    def end_round(self) -> None:
        """Its spans' KV is in the pool: autoregression goes on with the ``<sync/>``."""
        r, p = self.round, self.prompt_len
        self.rounds.append(RoundSpans((r.plan_start - p, r.start - p), tuple((a - p, b - p) for a, b in r.span_ranges),
                                      r.end - p, r.steps))
        self.round = None

    def _push(self, token: int, logprob: float, forced: bool) -> None:
        self.token_ids.append(token)
        self.logprobs.append(logprob)
        self.forced.append(forced)
