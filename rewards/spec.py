"""Typed reward settings: one record per reward term and ``RewardSpec``, the set a job scores with.

A job's reward is a weighted sum of terms (``CompositeReward``); each term present in the spec is
built here from its record. ``correctness`` is the task's verifier (``VERIFIERS``: exact integer
match for ``arith``, math_verify for ``math``); the cost terms are TIP's KV penalty, a thinking-
length penalty and Pasta's speedup (``rewards.terms``). Records are plain dataclasses that the
job config (pydantic) validates directly: an unknown term or option is a config error.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import ClassVar

from rewards.arith import ArithVerifier
from rewards.composite import CompositeReward
from rewards.math import END_THINK, MathReward
from rewards.record import Reward
from rewards.terms import KVPenalty, SpeedupReward, ThinkingPenalty

_CONFIG = {"extra": "forbid", "use_attribute_docstrings": True}


def _check_weight(weight: float, term: str) -> None:
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or weight != weight:
        raise ValueError(f"{term} weight must be a number, got {weight!r}")


@dataclass(frozen=True)
class CorrectnessTerm:
    """The task's verifier: 1 for a correct final answer, else 0."""

    __pydantic_config__: ClassVar[dict] = _CONFIG

    weight: float = 1.0
    """Weight of the term in the total reward."""
    end_think: str = END_THINK
    """Marker that ends the thinking; the answer is read after its last occurrence."""
    timeout_s: int = 5
    """math only: seconds math_verify may spend on each parse or comparison (>= 1)."""

    def __post_init__(self) -> None:
        _check_weight(self.weight, "correctness")
        if not self.end_think:
            raise ValueError("correctness end_think must be a non-empty string")
        if isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, int) or self.timeout_s < 1:
            raise ValueError(f"correctness timeout_s must be a whole number of seconds >= 1, got {self.timeout_s!r}")

    def build(self, task: str) -> Reward:
        if task in ("arith", "regmachine", "pasta"):  # generated tasks: exact integer match
            return ArithVerifier(end_think=self.end_think)
        return MathReward(timeout_s=self.timeout_s, end_think=self.end_think)


@dataclass(frozen=True)
class KVPenaltyTerm:
    """TIP's KV-cache penalty: ``-coef * max(0, kv - budget) / budget`` on the mean visible KV tokens."""

    __pydantic_config__: ClassVar[dict] = _CONFIG

    budget: float = 1024.0
    """Mean visible KV tokens per decode step allowed without penalty (> 0)."""
    coef: float = 1.0
    """Penalty at twice the budget (>= 0)."""
    weight: float = 1.0
    """Weight of the term in the total reward."""

    def __post_init__(self) -> None:
        _check_weight(self.weight, "kv_penalty")
        KVPenalty(self.budget, self.coef)  # its own checks name the bad value

    def build(self, task: str) -> Reward:
        return KVPenalty(self.budget, self.coef)


@dataclass(frozen=True)
class ThinkingPenaltyTerm:
    """Penalty on thinking tokens over a budget, same form as the KV penalty."""

    __pydantic_config__: ClassVar[dict] = _CONFIG

    budget: float = 1024.0
    """Thinking tokens allowed without penalty (> 0)."""
    coef: float = 1.0
    """Penalty at twice the budget (>= 0)."""
    end_think: str = END_THINK
    """Marker that ends the thinking."""
    weight: float = 1.0
    """Weight of the term in the total reward."""

    def __post_init__(self) -> None:
        _check_weight(self.weight, "thinking_penalty")
        ThinkingPenalty(self.budget, self.coef, self.end_think)

    def build(self, task: str) -> Reward:
        return ThinkingPenalty(self.budget, self.coef, self.end_think)


@dataclass(frozen=True)
class SpeedupTerm:
    """Pasta's theoretical speedup: generated tokens / critical path of the Pasta-Lang schedule."""

    __pydantic_config__: ClassVar[dict] = _CONFIG

    weight: float = 1.0
    """Weight of the term in the total reward."""

    def __post_init__(self) -> None:
        _check_weight(self.weight, "speedup")

    def build(self, task: str) -> Reward:
        return SpeedupReward()


@dataclass(frozen=True)
class RewardSpec:
    """The reward terms a job scores with; a term left at None is not part of the reward."""

    __pydantic_config__: ClassVar[dict] = _CONFIG

    correctness: CorrectnessTerm | None = field(default_factory=CorrectnessTerm)
    """The task's verifier (arith, regmachine, pasta: exact integer in the last boxed answer; math: math_verify)."""
    kv_penalty: KVPenaltyTerm | None = None
    """TIP's penalty on the mean visible KV tokens over a budget."""
    thinking_penalty: ThinkingPenaltyTerm | None = None
    """Penalty on thinking tokens over a budget."""
    speedup: SpeedupTerm | None = None
    """Pasta's theoretical speedup."""

    TERMS: ClassVar[tuple[str, ...]] = ("correctness", "kv_penalty", "thinking_penalty", "speedup")

    def __post_init__(self) -> None:
        if all(getattr(self, name) is None for name in self.TERMS):
            raise ValueError(f"the reward needs at least one term of {', '.join(self.TERMS)}")

    def build(self, task: str) -> CompositeReward:
        """The composite reward for ``task`` (arith | regmachine | pasta | math): every present term with its weight."""
        terms = {f.name: getattr(self, f.name) for f in fields(self)}
        return CompositeReward({name: (term.build(task), float(term.weight))
                                for name, term in terms.items() if term is not None})
