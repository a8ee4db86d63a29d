"""Which masked span positions a denoising step reveals: the runtime knobs of Planned Diffusion.

A round's spans denoise together, one forward per step over every still-masked position (``runtime``). Each
span has its own step budget, ``denoising_steps(length, steps_ratio)`` (``core.planned_diffusion``): variable-
length denoising, a span's steps scale with its length. At a step with ``s`` steps left and ``m`` positions
still masked, a span reveals ``ceil(m / s)`` of them, the first in its *order*:

- ``entropy`` (the default, as in the method): lowest predicted entropy first, ties by position;
- ``uniform``: a random order (a counter-based hash of the request's seed, the round, the step and the
  position, as ``rollout.sampling`` draws), which matches the training objective (every order equally likely).

With a ``confidence`` threshold, every masked position whose most likely token has at least that probability is
revealed too, at once, so a span may finish before its budget (never after it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from sliderl.core.planned_diffusion import denoising_steps

ORDERS = ("entropy", "uniform")


@dataclass(frozen=True)
class DenoisingKnobs:
    """The runtime's knobs (``EngineArgs.pd_steps_ratio``, ``pd_confidence``, ``pd_order``)."""

    steps_ratio: float = 1.0  # denoising steps per span token, in (0, 1]
    confidence: float | None = None  # reveal every position at least this confident, in (0, 1]; None: off
    order: str = "entropy"  # entropy | uniform

    def __post_init__(self) -> None:
        if not 0 < self.steps_ratio <= 1:
            raise ValueError(f"pd_steps_ratio must be in (0, 1] (denoising steps per span token), "
                             f"got {self.steps_ratio}")
        if self.confidence is not None and not 0 < self.confidence <= 1:
            raise ValueError(f"pd_confidence must be None or in (0, 1], got {self.confidence}")
        if self.order not in ORDERS:
            raise ValueError(f"pd_order must be one of {', '.join(ORDERS)}, got {self.order!r}")


@dataclass
class SpanState:
    """One span of a round: its body's token indices in the request and what is still masked."""

    body_start: int  # token index of its first body position
    length: int  # body positions (UNIT · N of its plan item)
    budget: int  # denoising steps it may take
    steps: int = 0  # denoising steps taken
    masked: list[int] = field(default_factory=list)  # token indices still masked, increasing

    @classmethod
    def scaffold(cls, body_start: int, length: int, knobs: DenoisingKnobs) -> SpanState:
        return cls(body_start, length, denoising_steps(length, knobs.steps_ratio),
                   masked=list(range(body_start, body_start + length)))

    @property
    def done(self) -> bool:
        return not self.masked


def choose_reveals(span: SpanState, priority: list[float], confidence: list[float], knobs: DenoisingKnobs) -> list[int]:
    """The token indices ``span`` reveals this step (increasing). ``priority[i]`` and ``confidence[i]`` belong to
    ``span.masked[i]``: the ordering key (entropy, or the uniform order's random key; lower first) and the most
    likely token's probability."""
    m = len(span.masked)
    if m == 0:
        return []
    if not len(priority) == len(confidence) == m:
        raise ValueError(f"{m} masked positions but {len(priority)} priorities and {len(confidence)} confidences")
    steps_left = max(span.budget - span.steps, 1)
    k = math.ceil(m / steps_left)
    order = sorted(range(m), key=lambda i: (priority[i], i))
    chosen = set(order[:k])
    if knobs.confidence is not None:
        chosen |= {i for i in range(m) if confidence[i] >= knobs.confidence}
    return [span.masked[i] for i in sorted(chosen)]


def reveal(span: SpanState, positions: list[int]) -> None:
    """Those positions are revealed: one more step taken."""
    gone = set(positions)
    span.masked = [p for p in span.masked if p not in gone]
    span.steps += 1
