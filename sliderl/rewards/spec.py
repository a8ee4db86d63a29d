"""Typed reward settings: one record per reward term and ``RewardSpec``, the set a job scores with.

A job's reward is a weighted sum of terms (``CompositeReward``); each term present in the spec is
built here from its record. ``correctness`` is the task's verifier (``VERIFIERS``: exact integer
match for ``arith``, math_verify for ``math``); the cost terms are TIP's KV penalty, a thinking-
length penalty and Pasta's theoretical speedup (``rewards.terms``). Records are plain dataclasses that the
job config (pydantic) validates directly: an unknown term or option is a config error.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import ClassVar

from sliderl.core.vocab import END_THINK
from sliderl.rewards.arith import ArithVerifier
from sliderl.rewards.composite import CompositeReward
from sliderl.rewards.math import MathReward
from sliderl.rewards.record import Reward
from sliderl.rewards.terms import CostPenalty, KVPenalty, SpeedupReward, ThinkingPenalty

_CONFIG = {"extra": "forbid", "use_attribute_docstrings": True}
RENAMED_COEF = ("weight: a term has one multiplier now; coef was folded into weight, so write weight = your "
                "weight x coef (e.g. {budget: 64, coef: 0.5} becomes {budget: 64, weight: 0.5})")


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

    def build(self, task: str, tokenizer=None) -> Reward:
        if task in ("arith", "regmachine", "pasta", "planned_diffusion"):  # generated tasks: exact integer match
            return ArithVerifier(end_think=self.end_think)
        return MathReward(timeout_s=self.timeout_s, end_think=self.end_think)


@dataclass(frozen=True)
class KVPenaltyTerm:
    """TIP's KV-cache penalty: ``-weight * max(0, kv - budget) / budget`` on the mean visible KV tokens."""

    __pydantic_config__: ClassVar[dict] = _CONFIG
    RENAMED: ClassVar[dict[str, str]] = {"coef": RENAMED_COEF}

    budget: float = 1024.0
    """Mean visible KV tokens per decode step allowed without penalty (> 0)."""
    weight: float = 1.0
    """Weight of the term in the total reward: the penalty at twice the budget is -weight."""

    def __post_init__(self) -> None:
        _check_weight(self.weight, "kv_penalty")
        KVPenalty(self.budget)  # its own checks name the bad value

    def build(self, task: str, tokenizer=None) -> Reward:
        return KVPenalty(self.budget)


@dataclass(frozen=True)
class CostPenaltyTerm:
    """Penalty on a trace's compute over a budget, same form as the KV penalty (``rewards.terms.CostPenalty``)."""

    __pydantic_config__: ClassVar[dict] = _CONFIG

    measure: str = "kv_token_steps"
    """kv_token_steps (sum over generated tokens of the KV tokens their query saw), reencoded_tokens (tokens encoded
    again at last_k / summary restarts) or num_restarts."""
    budget: float = 65536.0
    """The measure allowed without penalty (> 0)."""
    weight: float = 1.0
    """Weight of the term in the total reward: the penalty at twice the budget is -weight."""

    def __post_init__(self) -> None:
        _check_weight(self.weight, "cost_penalty")
        CostPenalty(self.measure, self.budget)  # its own checks name the bad value

    def build(self, task: str, tokenizer=None) -> Reward:
        return CostPenalty(self.measure, self.budget)


@dataclass(frozen=True)
class ThinkingPenaltyTerm:
    """Penalty on thinking tokens over a budget, same form as the KV penalty."""

    __pydantic_config__: ClassVar[dict] = _CONFIG

    RENAMED: ClassVar[dict[str, str]] = {"coef": RENAMED_COEF}

    budget: float = 1024.0
    """Thinking tokens allowed without penalty (> 0)."""
    end_think: str = END_THINK
    """Marker that ends the thinking."""
    weight: float = 1.0
    """Weight of the term in the total reward: the penalty at twice the budget is -weight."""

    def __post_init__(self) -> None:
        _check_weight(self.weight, "thinking_penalty")
        ThinkingPenalty(self.budget, self.end_think)

    def build(self, task: str, tokenizer=None) -> Reward:
        return ThinkingPenalty(self.budget, self.end_think)


@dataclass(frozen=True)
class SpeedupTerm:
    """Pasta's theoretical speedup (thesis §3.4): Baseline-SFT's response length for the prompt / the critical
    path of the Pasta-Lang response (``rewards.terms.SpeedupReward``). Needs ``engine.kv=pasta``.

    Baseline-SFT's lengths are generated once per training prompt (greedy, under kv=full) at the start of the
    run and kept in ``run_dir/baseline_lengths.json`` (``cluster.actors.baseline``). With BoNBoN the samples
    are ranked by ``speedup + λ·quality``, λ being ``learner.algo.quality_weight`` and quality the
    ``correctness`` term: the task's verifier (1 right, 0 wrong) — no LLM judge, unlike the thesis.
    """

    __pydantic_config__: ClassVar[dict] = _CONFIG

    baseline_model: str | None = None
    """The Baseline-SFT checkpoint (a local Hugging Face directory: the same data without annotations, trained
    under kv=full) whose greedy response lengths are the speedup's numerator; required."""
    weight: float = 1.0
    """Weight of the term in the total reward."""

    def __post_init__(self) -> None:
        _check_weight(self.weight, "speedup")
        if not self.baseline_model:
            raise ValueError("speedup needs baseline_model: the Baseline-SFT checkpoint whose greedy response length "
                             "for each prompt is the speedup's numerator (e.g. reward.speedup.baseline_model="
                             f"runs/pasta-base/model), got {self.baseline_model!r}")

    def build(self, task: str, tokenizer=None) -> Reward:
        if tokenizer is None:
            raise ValueError("the speedup term reads token ids: build it with the policy's tokenizer")
        return SpeedupReward(tokenizer)


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
    """Pasta's theoretical speedup: Baseline-SFT's length for the prompt / the response's critical path."""
    cost_penalty: CostPenaltyTerm | None = None
    """Penalty on a trace's compute over a budget: KV-token-steps, tokens re-encoded at restarts, or restarts."""

    TERMS: ClassVar[tuple[str, ...]] = ("correctness", "kv_penalty", "thinking_penalty", "speedup", "cost_penalty")

    def __post_init__(self) -> None:
        if all(getattr(self, name) is None for name in self.TERMS):
            raise ValueError(f"the reward needs at least one term of {', '.join(self.TERMS)}")

    def build(self, task: str, tokenizer=None) -> CompositeReward:
        """The composite reward for ``task`` (arith | regmachine | pasta | math): every present term with its weight;
        ``tokenizer`` (the policy's) for the terms that read token ids (speedup)."""
        terms = {f.name: getattr(self, f.name) for f in fields(self)}
        return CompositeReward({name: (term.build(task, tokenizer), float(term.weight))
                                for name, term in terms.items() if term is not None})
