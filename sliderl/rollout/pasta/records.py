"""What a finished Pasta request reports beside its flattened response: its forks, counters and speed."""

from __future__ import annotations

from dataclasses import dataclass

from sliderl.rollout.sequence import RequestOutput


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
    """A finished Pasta request's threads and speed (``PastaRequestOutput.pasta``).

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
class PastaRequestOutput(RequestOutput):
    """A finished request under ``kv="pasta"``: ``token_ids`` is the flattened response (``core.pasta``) and
    ``pasta`` its threads and speed; the tags the runtime inserted are forced, with logprob 0.0."""

    pasta: PastaOutput | None = None
