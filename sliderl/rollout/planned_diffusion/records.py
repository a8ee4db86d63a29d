"""What a finished Planned Diffusion request reports beside its flattened response: its rounds, counts and cost."""

from __future__ import annotations

from dataclasses import dataclass, field

from sliderl.rollout.sequence import RequestOutput


@dataclass(frozen=True)
class RoundSpans:
    """One executed round, in output indices (the completion's, prompt not counted)."""

    plan: tuple[int, int]  # [start, end) of its promises
    spans: tuple[tuple[int, int], ...]  # [start, end) of each ``<async> … </async>``
    sync: int  # its ``<sync/>``
    denoising_steps: int  # forwards it took before its commit (the slowest span's steps)


@dataclass
class PDCounts:
    """What the runtime read as plain text, per request."""

    unclosed_promises: int = 0  # ``<promise`` interrupted by another tag or by the end
    plans_without_spans: int = 0  # plans followed by anything but ``<sync/>``: plain text
    promises_without_units: int = 0  # planned with DEFAULT_PROMISE_UNITS
    stray_tags: int = 0  # ``/>``, ``<async>``, ``</async>`` outside a promise
    plans_over_length: int = 0  # a plan whose scaffold would pass max_tokens / max_model_len: the request ends


@dataclass
class PDOutput:
    """A finished request's rounds and what it cost (``PDRequestOutput.planned_diffusion``).

    ``forward_passes`` is the request's sequential forwards: the engine steps in which it had a row (prefill
    chunks and one decode per autoregressive token), its denoising forwards and one commit forward per round.
    ``speedup`` = the flattened response's tokens / ``forward_passes``: 1.0 for a response without rounds decoded
    one token per step, more when spans denoise several tokens per forward.
    """

    rounds: list[RoundSpans]
    forward_passes: int
    denoising_forwards: int
    commit_forwards: int
    autoregressive_tokens: int
    span_tokens: int  # body positions (content and <null>)
    counts: PDCounts = field(default_factory=PDCounts)

    @property
    def speedup(self) -> float:
        return (self.autoregressive_tokens + self.span_tokens) / max(self.forward_passes, 1)


@dataclass
class PDRequestOutput(RequestOutput):
    """A finished request under ``kv="planned_diffusion"``: ``token_ids`` is the flattened response
    (``core.planned_diffusion``: span tags forced with logprob 0.0; a body token's logprob is its reveal's), ``text``
    it decoded without ``<null>``, and ``planned_diffusion`` its rounds and cost."""

    planned_diffusion: PDOutput | None = None
