"""Rewards: verifiers and reward terms that score one completion into a ``RewardRecord``.

Owns math correctness (``MathReward``, math_verify), TIP's KV-cache penalty (``KVPenalty``), a
thinking-length penalty, a compute penalty (``CostPenalty``), Pasta's theoretical speedup (``SpeedupReward``: Baseline-SFT's length over the
critical path of ``core.pasta.PastaLayout``) and their weighted sum (``CompositeReward``, built from the
typed ``RewardSpec``). Plain Python: no Ray; math_verify is imported on first verification, torch
(``core.pasta``) by the speedup term when it is built.
"""

from sliderl.rewards.composite import CompositeReward
from sliderl.rewards.math import MathReward
from sliderl.rewards.record import Reward, RewardInput, RewardRecord
from sliderl.rewards.spec import (
    CorrectnessTerm,
    CostPenaltyTerm,
    KVPenaltyTerm,
    RewardSpec,
    SpeedupTerm,
    ThinkingPenaltyTerm,
)
from sliderl.rewards.terms import CostPenalty, KVPenalty, SpeedupReward, ThinkingPenalty

__all__ = [
    "CompositeReward",
    "CorrectnessTerm",
    "CostPenalty",
    "CostPenaltyTerm",
    "KVPenaltyTerm",
    "KVPenalty",
    "MathReward",
    "Reward",
    "RewardInput",
    "RewardRecord",
    "RewardSpec",
    "SpeedupReward",
    "SpeedupTerm",
    "ThinkingPenalty",
    "ThinkingPenaltyTerm",
]
