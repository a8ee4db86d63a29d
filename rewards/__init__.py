"""Rewards: verifiers and reward terms that score one completion into a ``RewardRecord``.

Owns math correctness (``MathReward``, math_verify), TIP's KV-cache penalty (``KVPenalty``), a
thinking-length penalty, Pasta's theoretical speedup (``SpeedupReward`` over Pasta-Lang, parsed
in ``pasta_lang``) and their weighted sum (``CompositeReward``, built from the typed ``RewardSpec``). Plain Python: no Ray,
no torch; math_verify is imported on first verification.
"""

from rewards.composite import CompositeReward
from rewards.math import MathReward
from rewards.record import Reward, RewardInput, RewardRecord
from rewards.spec import (CorrectnessTerm, KVPenaltyTerm, RewardSpec, SpeedupTerm,
                          ThinkingPenaltyTerm)
from rewards.terms import KVPenalty, SpeedupReward, ThinkingPenalty

__all__ = [
    "CompositeReward",
    "CorrectnessTerm",
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
