"""A request under a restart policy inside the engine: its current context, apart from what it generated.

``RestartSequence.token_ids`` is the *context* the engine computes — the prompt (or its kept part), the tokens a
restart carried over, then the current segment's tokens — at positions ``0 .. len - 1`` (positions restart
after the kept prompt at every restart: the new context is encoded afresh). ``generated`` is the request's
output: every token it generated, segment after segment. A restart (``restart``) replaces the context, drops
every block past the kept prompt's and leaves ``num_computed`` at the kept prompt, so the scheduler prefills the
new context's tail in chunks like any prompt. Within a context every key is visible: no block dies while it runs.
"""

from __future__ import annotations

from typing import Protocol

from sliderl.core.restart import Restart
from sliderl.rollout.sampling import SamplingParams
from sliderl.rollout.sequence import Sequence


class RestartRule(Protocol):
    """What a restart mode says about a sequence's next token (``rollout.restart.mode``)."""

    def restarts_next(self, seq: RestartSequence) -> bool:
        """Whether the token it samples next may end its context (a restart)."""

    def forces_next(self, seq: RestartSequence) -> bool:
        """Whether the token it samples next will be replaced by a forced one (summary forcing)."""


class RestartSequence(Sequence):
    """One request under ``last_k`` or ``summary`` (module docstring); ``rule`` is its mode."""

    def __init__(self, rule: RestartRule, block_bound: int, request_id: int, prompt_token_ids: list[int],
                 params: SamplingParams, seed: int, tracker, block_size: int, arrival: float, *, max_model_len: int,
                 max_chunk: int):
        super().__init__(request_id, prompt_token_ids, params, seed, tracker, block_size, arrival,
                         max_model_len=max_model_len, max_chunk=max_chunk)
        self.rule = rule
        self.block_bound = block_bound
        self.generated: list[int] = []
        self.base = self.prompt_len  # context tokens before the current segment's generated part
        self.restarts: list[Restart] = []
        self.call_start: int | None = None  # summary: completion index of the open call's first token
        self.call_forced = False  # summary: the open call was opened by summary forcing

    @property
    def output_token_ids(self) -> list[int]:
        return self.generated

    @property
    def num_output(self) -> int:
        return len(self.generated)

    @property
    def segment_tokens(self) -> int:
        """The generated part of the current context (last_k: kept tokens included)."""
        return len(self.token_ids) - self.base

    @property
    def may_be_forced(self) -> bool:
        return super().may_be_forced or self.rule.forces_next(self)

    @property
    def may_run_ahead(self) -> bool:
        return not self.rule.restarts_next(self)

    def append_token(self, token: int, logprob: float, forced: bool) -> list[tuple[int, int]]:
        killed = super().append_token(token, logprob, forced)
        self.generated.append(token)
        return killed

    def block_completed(self, j: int) -> None:
        pass  # every key of a context stays visible while the context lasts

    def restart(self, record: Restart, base: int) -> list[int]:
        """Continue from ``record``'s context, whose generated part starts after ``base`` tokens; returns the
        physical blocks to free (every block past the kept prompt's; the block holding its last token stays, and
        the re-prefill overwrites the rest of it)."""
        keep, bs = record.kept_prompt, self.block_size
        assert keep <= self.num_computed, (keep, self.num_computed)
        self.token_ids = record.context(self.prompt_token_ids)
        self.num_computed = keep
        self.base = base
        self.restarts.append(record)
        self.call_start, self.call_forced = None, False
        self.tracker = self.tracker.policy.tracker(self.prompt_len)
        for pos, tok in enumerate(self.token_ids):
            self.tracker.append(pos, tok)
        return [self.remove_block(j) for j in list(self.blocks) if j * bs >= keep]
