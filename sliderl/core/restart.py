"""Restarts: the Prefix Sliding paper's two baselines that bound memory by restarting generation (its Appendix G).

Both bound the *generated part* of the context — the tokens after the prompt (and, for ``summary``, after the
summary template) — to N tokens. When it reaches N, the context is replaced by a new one, encoded afresh:

- ``last_k:N:K``: the prompt plus the last K generated tokens, at positions ``P .. P+K-1`` right after the
  prompt (P = prompt length; the prompt's own K/V stays). Cuts fall wherever they fall. The kept tokens count
  in the new context's generated part, so every segment after the first generates N - K new tokens: the total
  of new (thinking) tokens matches Prefix Sliding's at equal budget (the paper's budget rule).
- ``summary:N:S``: the model writes its own summary as a tool call, at most S tokens from the call's opening to
  its closing. When S tokens are left before the generated part reaches N and no call is open, the engine
  force-inserts the opening (summary forcing); the closing is forced when the call reaches S tokens. The
  model may also open the call itself, earlier. At the call's end the context becomes the prompt with the
  summary inserted by the template (the paper's Figure 17: the problem, then ``Context: …``), and the
  generated part starts at 0 again: the summary is not charged against the budget.

A *segment* is what one context generated. The trace keeps every generated token in order (``Trace``'s
completion: the segments one after another, summary calls included) and one ``Restart`` record per restart,
holding the new context (``Restart.context``), so that the learner scores each segment under exactly the
context the sampler had (``segments``): the carried tokens are context there (re-encoded, not trained twice),
a summary call is the model's own output.

``SummaryTool`` holds the tool's settings (the paper's defaults); ``SummaryTokens`` is one bound to a tokenizer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from sliderl.core.kv_policy import KVPolicy

TOOL_OPEN = "<tool_call>"
TOOL_CLOSE = "</tool_call>"
RESTART_TOKENS = (TOOL_OPEN, TOOL_CLOSE)  # what ``summary`` adds to a vocabulary that lacks them (Qwen3 has both)


@dataclass(frozen=True)
class Restart:
    """One restart of a trace: the context its next segment was generated under.

    The new context is ``prompt[:kept_prompt] + context_tail``: the prompt tokens whose K/V stays, then the
    tokens encoded afresh at positions ``kept_prompt ...`` (last_k: the K kept tokens; summary: the template with
    the summary, the rest of the prompt and ``resume``). Indices are completion indices.
    """

    at: int  # completion index of the new segment's first token
    kept_prompt: int  # leading prompt tokens kept as they were (their K/V is not recomputed)
    context_tail: list[int]  # the rest of the new context, re-encoded at the restart
    carry_start: int  # [carry_start, carry_end): the generated tokens carried over (kept tokens / the summary)
    carry_end: int
    forced: bool  # the engine restarted it: a last_k cut, a summary call opened by summary forcing

    def context(self, prompt: Sequence[int]) -> list[int]:
        """The new context's token ids."""
        return [*prompt[:self.kept_prompt], *self.context_tail]


@dataclass(frozen=True)
class Segment:
    """What one context generated: completion tokens ``[start, end)``, under ``context`` (token ids)."""

    context: list[int]
    start: int
    end: int


def segments(prompt: Sequence[int], num_generated: int, restarts: Sequence[Restart]) -> list[Segment]:
    """The segments of a trace of ``num_generated`` tokens: the first under the prompt, one after each restart.

    A restart at the trace's very end (the last token triggered it, nothing generated after) gives no segment.
    Raises ValueError for restarts out of order or outside the trace.
    """
    cuts = [r.at for r in restarts]
    if any(b <= a for a, b in zip([0, *cuts], [*cuts, num_generated + 1])):
        raise ValueError(f"restarts at completion indices {cuts} do not fit a trace of {num_generated} tokens "
                         "(need 0 < at_1 < at_2 < ... <= length)")
    starts = [0, *cuts]
    contexts = [list(prompt), *[r.context(prompt) for r in restarts]]
    ends = [*cuts, num_generated]
    return [Segment(c, a, b) for c, a, b in zip(contexts, starts, ends) if b > a]


def last_k_restart(prompt_len: int, generated: Sequence[int], at: int, keep: int) -> Restart:
    """The last_k restart after completion token ``at - 1``: the prompt, then the last ``keep`` tokens generated."""
    return Restart(at, prompt_len, list(generated[at - keep:at]), at - keep, at, True)


@dataclass(frozen=True)
class SummaryTool:
    """The summary tool call and where its summary goes (the paper's Figures 16-17 by default).

    The call is ``open`` + the call prefix + the summary + the call suffix + ``close``; with ``json_call`` the
    prefix and suffix wrap the summary as the call's JSON (``{"name": "pass", "arguments": {"context": "…"}}``),
    without it the summary stands alone between the two tokens (a small model's budget). The new context inserts
    ``template`` (``{summary}`` replaced by the summary) into the prompt before its last ``insert_before`` (the
    user turn's end) or, when the prompt lacks it, after the prompt; ``resume`` follows the prompt.
    """

    __pydantic_config__: ClassVar[dict] = {"extra": "forbid", "use_attribute_docstrings": True}

    open: str = TOOL_OPEN
    """The token that opens the call (one token of the vocabulary)."""
    close: str = TOOL_CLOSE
    """The token that closes the call (one token of the vocabulary)."""
    name: str = "pass"
    """The tool's name, in the call's JSON."""
    argument: str = "context"
    """The argument that holds the summary, in the call's JSON."""
    json_call: bool = True
    """Wrap the summary in the call's JSON; false: the summary alone between open and close."""
    template: str = "\nContext: {summary}"
    """Inserted into the prompt with the summary (exactly one ``{summary}``)."""
    insert_before: str = "<|im_end|>"
    """The template goes before the prompt's last occurrence of this text; after the prompt when absent or empty."""
    resume: str = ""
    """Text after the prompt that opens the new segment (empty: the model opens its thinking itself)."""

    def __post_init__(self) -> None:
        for name in ("open", "close"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ValueError(f"summary tool {name} must be a non-empty token, got {getattr(self, name)!r}")
        if self.open == self.close:
            raise ValueError(f"summary tool open and close must differ, both are {self.open!r}")
        if not isinstance(self.template, str) or self.template.count("{summary}") != 1:
            raise ValueError(f"summary template must contain {{summary}} exactly once, got {self.template!r}")

    @property
    def call_prefix(self) -> str:
        return f'{{"name": "{self.name}", "arguments": {{"{self.argument}": "' if self.json_call else ""

    @property
    def call_suffix(self) -> str:
        return '"}}' if self.json_call else ""

    def bind(self, tokenizer) -> SummaryTokens:
        """Token ids of the call and the template under ``tokenizer`` (which must hold ``open`` and ``close``)."""
        vocab = tokenizer.get_vocab()
        missing = [t for t in (self.open, self.close) if t not in vocab]
        if missing:
            raise ValueError(f"the summary tool's {missing[0]!r} is not a token of the tokenizer; add it (the summary "
                             f"policy adds {TOOL_OPEN} and {TOOL_CLOSE}) or set the tool's open/close to tokens it has")
        encode = lambda text: tuple(tokenizer.encode(text, add_special_tokens=False)) if text else ()  # noqa: E731
        before, after = self.template.split("{summary}")
        return SummaryTokens(vocab[self.open], vocab[self.close], encode(self.call_prefix), encode(self.call_suffix),
                             encode(before), encode(after), encode(self.insert_before), encode(self.resume))


@dataclass(frozen=True)
class SummaryTokens:
    """A ``SummaryTool`` in token ids: what the engine forces and how it builds the context after a summary."""

    open_id: int
    close_id: int
    prefix: tuple[int, ...]
    suffix: tuple[int, ...]
    template_before: tuple[int, ...]
    template_after: tuple[int, ...]
    insert_before: tuple[int, ...]
    resume: tuple[int, ...]

    @property
    def opening(self) -> list[int]:
        """The call's opening: the open token, then the call prefix."""
        return [self.open_id, *self.prefix]

    @property
    def closing(self) -> list[int]:
        """The call's closing: the call suffix, then the close token."""
        return [*self.suffix, self.close_id]

    def min_call(self) -> int:
        """The fewest tokens of a call: its opening, one summary token, its closing."""
        return len(self.opening) + 1 + len(self.closing)

    def template_tokens(self) -> int:
        """Tokens a new context adds to the prompt besides the summary."""
        return len(self.template_before) + len(self.template_after) + len(self.resume)

    def summary_of(self, call: Sequence[int]) -> list[int]:
        """The summary inside a whole call (``open`` … ``close``): without the opening, and without the closing
        (its suffix only where the call has it)."""
        body = list(call[len(self.opening):-1])
        n = len(self.suffix)
        return body[:-n] if n and body[-n:] == list(self.suffix) else body

    def insertion_point(self, prompt: Sequence[int]) -> int:
        """Where the template goes in ``prompt``: before the last ``insert_before``, else at its end."""
        n, prompt = len(self.insert_before), list(prompt)
        if n:
            for i in range(len(prompt) - n, -1, -1):
                if prompt[i:i + n] == list(self.insert_before):
                    return i
        return len(prompt)

    def restart(self, prompt: Sequence[int], generated: Sequence[int], call_start: int, at: int,
                forced: bool) -> Restart:
        """The restart after the call ``generated[call_start:at]`` (``at - 1``: its ``close``)."""
        summary = self.summary_of(generated[call_start:at])
        start = call_start + len(self.opening)
        keep = self.insertion_point(prompt)
        tail = [*self.template_before, *summary, *self.template_after, *prompt[keep:], *self.resume]
        return Restart(at, keep, tail, start, start + len(summary), forced)


def written_restarts(policy: KVPolicy, prompt: Sequence[int], completion: Sequence[int],
                     tokens: SummaryTokens | None = None) -> list[Restart]:
    """The restarts of a written completion (a demonstration) under a restart policy, as the engine would make them
    while generating it: last_k's cuts at N, N + (N - K), ...; summary's at the end of each tool call in it (a
    complete ``open`` … ``close``; the written calls are the model's, never forced). None at the very end."""
    out: list[Restart] = []
    if policy.kind == "last_k":
        n, k = policy.restart_at, policy.carry
        return [last_k_restart(len(prompt), completion, at, k) for at in range(n, len(completion), n - k)]
    start = None
    for i, token in enumerate(completion):
        if start is None and token == tokens.open_id:
            start = i
        elif start is not None and token == tokens.close_id and i + 1 - start > len(tokens.opening):
            if i + 1 < len(completion):
                out.append(tokens.restart(prompt, completion, start, i + 1, False))
            start = None
    return out


def context_bound(policy: KVPolicy, prompt_len: int, tokens: SummaryTokens | None) -> int:
    """The most tokens a context of a restart policy holds: the prompt and N generated tokens, plus for summary
    the template and the longest summary (S less the call's opening and closing)."""
    if policy.kind == "last_k":
        return prompt_len + policy.restart_at
    longest = policy.carry - len(tokens.opening) - len(tokens.closing)
    return prompt_len + tokens.template_tokens() + longest + policy.restart_at
