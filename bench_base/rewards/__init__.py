"""Rewards: verifiers and reward terms that score one completion into a ``RewardRecord``.

Owns math correctness (``MathReward``, math_verify), TIP's KV-cache penalty (``KVPenalty``), a
thinking-length penalty, Pasta's theoretical speedup (``SpeedupReward`` over Pasta-Lang, parsed
in ``pasta_lang``) and their weighted sum (``CompositeReward.from_config``). Plain Python: no Ray,
no torch; math_verify is imported on first verification.
"""

from rewards.composite import REWARDS, CompositeReward
from rewards.math import MathReward
from rewards.record import Reward, RewardInput, RewardRecord
from rewards.terms import KVPenalty, SpeedupReward, ThinkingPenalty

__all__ = [
    "REWARDS",
    "CompositeReward",
    "KVPenalty",
    "MathReward",
    "Reward",
    "RewardInput",
    "RewardRecord",
    "SpeedupReward",
    "ThinkingPenalty",
]
