"""The restart modes (``LLM(model, kv="last_k:N:K")``, ``kv="summary:N:S"``): when a context ends and what follows.

The rules are ``core.restart``'s; here is how the engine applies them, at the seam's points:

- **admit**: a ``RestartSequence`` per request; its block bound is the longest context's blocks
  (``core.restart.context_bound``: the prompt and N generated tokens, plus for summary the template and the
  longest summary), so the scheduler admits by it and never preempts.
- **after sampling** (``take``): the token is appended (or the forced one in its place), stops are checked as for
  any request, then the mode acts. ``last_k``: when the context's generated part reaches N, the context becomes
  the prompt and the last K generated tokens. ``summary``: when the token would be the generated part's
  ``N - S``-th and no call is open, the call's opening is forced in its place (summary forcing); a call open
  for ``S - len(closing)`` tokens gets its closing forced; the model may open a call itself (the engine then
  writes the call prefix) and close it itself; at the call's end the context becomes the prompt with the summary.
  A restart frees the old context's blocks at once (``RestartSequence.restart``); the scheduler prefills the
  new tail in chunks, batched beside other sequences' decodes.
- **overlap**: no decode step is queued ahead over a token that may restart its context (``last_k``'s N-th,
  any token of an open summary call) or that forcing replaces, so no queued row ever goes stale.

Forced tokens (the call's opening, prefix and closing) carry the sampler-convention logprob of the forced token
and ``forced`` True: the learner never trains them. The summary between them is the model's own output.
"""

from __future__ import annotations

import torch

from sliderl.core.restart import Restart, SummaryTokens, context_bound, last_k_restart
from sliderl.rollout.block_bound import kv_positions
from sliderl.rollout.mode import DecodingMode, EngineContext, TokenSteps
from sliderl.rollout.restart.records import RestartRequestOutput
from sliderl.rollout.restart.sequence import RestartSequence
from sliderl.rollout.sampling import SamplingParams


class RestartMode(DecodingMode):
    """The shared part of ``last_k`` and ``summary``: sequences, bounds, the step after sampling, outputs."""

    name = "restart"

    def __init__(self, context: EngineContext, args):
        super().__init__(context, args)
        self.n = context.policy.restart_at
        self.carry = context.policy.carry

    # ---- admit ------------------------------------------------------------------------------------
    def new_request(self, request_id: int, prompt: list[int], params: SamplingParams, seed: int,
                    arrival: float) -> RestartSequence:
        c = self.context
        return RestartSequence(self, self.block_bound(len(prompt), params.max_tokens), request_id, prompt, params,
                               seed, c.policy.tracker(len(prompt)), c.block_size, arrival,
                               max_model_len=c.max_model_len, max_chunk=c.max_chunk)

    def block_bound(self, prompt_len: int, max_tokens: int) -> int:
        """Blocks of the longest context: ``context_bound``, or fewer when ``max_tokens`` ends the request first."""
        c = self.context
        longest = min(context_bound(c.policy, prompt_len, self.tokens), self.longest_without(prompt_len, max_tokens))
        return -(-min(longest, kv_positions(0, longest, c.max_model_len)) // c.block_size)

    def longest_without(self, prompt_len: int, max_tokens: int) -> int:
        """The longest context when ``max_tokens`` is what bounds it (last_k: kept tokens are outputs too)."""
        return prompt_len + max_tokens

    def smaller_request(self) -> str:
        return "N, the prompt or max_tokens"

    @property
    def tokens(self) -> SummaryTokens | None:
        return None

    # ---- after sampling ---------------------------------------------------------------------------
    def take(self, post: TokenSteps, seq: RestartSequence, token: int, logprob: float, logits: torch.Tensor) -> bool:
        self.force(seq)
        post.append(seq, token, logprob, logits)
        if post.stops(seq):
            post.finish(seq)
            return True
        record = self.after(seq)
        if record is None:
            return False
        if len(record.context(seq.prompt_token_ids)) >= self.context.max_model_len:
            seq.finish_reason = "length"  # the new context leaves no room to generate
            post.finish(seq)
            return True
        base = record.kept_prompt + len(record.context_tail) if self.tokens is not None else seq.prompt_len
        for block in seq.restart(record, base):
            self.context.scheduler.blocks.free(block)
        return False

    def force(self, seq: RestartSequence) -> None:
        """Put forced tokens due at the token being taken into ``seq.pending_forced`` (none here)."""

    def after(self, seq: RestartSequence) -> Restart | None:
        """``seq`` took a token and goes on: the restart it causes, if any."""
        raise NotImplementedError

    def restarts_next(self, seq: RestartSequence) -> bool:
        raise NotImplementedError

    def forces_next(self, seq: RestartSequence) -> bool:
        return False

    # ---- finish -----------------------------------------------------------------------------------
    def output(self, post: TokenSteps, seq: RestartSequence) -> RestartRequestOutput:
        return RestartRequestOutput(seq.request_id, seq.prompt_token_ids, list(seq.generated), seq.logprobs,
                                    post.text(seq, seq.generated), seq.finish_reason, seq.kv, seq.forced,
                                    seq.num_preemptions, seq.finished_at - seq.arrival, [],
                                    [t - seq.arrival for t in seq.token_times], restarts=list(seq.restarts))


class LastKMode(RestartMode):
    """``last_k:N:K``: at N generated tokens in the context, restart from the prompt and the last K."""

    name = "last_k"

    def after(self, seq: RestartSequence) -> Restart | None:
        if seq.segment_tokens < self.n:
            return None
        return last_k_restart(seq.prompt_len, seq.generated, seq.num_output, self.carry)

    def restarts_next(self, seq: RestartSequence) -> bool:
        return seq.segment_tokens + 1 >= self.n


class SummaryMode(RestartMode):
    """``summary:N:S``: the model summarises in a tool call (forced when S tokens are left), then the context
    restarts from the prompt with the summary inserted (``EngineArgs.summary_tool``)."""

    name = "summary"

    def __init__(self, context: EngineContext, args):
        super().__init__(context, args)
        self._tokens = args.summary_tool.bind(context.tokenizer)
        if self.carry < self._tokens.min_call():
            raise ValueError(f"{context.policy.spec}: S={self.carry} cannot hold the summary call's opening "
                             f"({len(self._tokens.opening)} tokens), one summary token and its closing "
                             f"({len(self._tokens.closing)}); raise S to at least {self._tokens.min_call()} or set "
                             "summary_tool.json_call=false")

    @property
    def tokens(self) -> SummaryTokens:
        return self._tokens

    def longest_without(self, prompt_len: int, max_tokens: int) -> int:
        longest = self.carry - len(self._tokens.opening) - len(self._tokens.closing)
        return prompt_len + self._tokens.template_tokens() + longest + max_tokens

    def force(self, seq: RestartSequence) -> None:
        if seq.pending_forced:
            return
        if seq.call_start is None and seq.segment_tokens == self.n - self.carry:
            seq.pending_forced = list(self._tokens.opening)
            seq.call_forced = True
        elif seq.call_start is not None and seq.num_output - seq.call_start == self.carry - len(self._tokens.closing):
            seq.pending_forced = list(self._tokens.closing)

    def after(self, seq: RestartSequence) -> Restart | None:
        token, tokens = seq.generated[-1], self._tokens
        if seq.call_start is None:
            if token == tokens.open_id:
                seq.call_start = seq.num_output - 1
                if not seq.call_forced:  # the model called the tool: the engine writes the call prefix
                    seq.pending_forced = list(tokens.prefix)
            return None
        if token != tokens.close_id or seq.num_output - seq.call_start < len(tokens.opening) + 1:
            return None
        return tokens.restart(seq.prompt_token_ids, seq.generated, seq.call_start, seq.num_output, seq.call_forced)

    def restarts_next(self, seq: RestartSequence) -> bool:
        return seq.call_start is not None

    def forces_next(self, seq: RestartSequence) -> bool:
        return seq.call_start is None and seq.segment_tokens == self.n - self.carry
