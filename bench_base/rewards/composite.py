"""A weighted sum of reward terms, built from a config dict."""

from __future__ import annotations

import inspect
from collections.abc import Mapping

from rewards.math import MathReward
from rewards.record import Reward, RewardInput, RewardRecord
from rewards.terms import KVPenalty, SpeedupReward, ThinkingPenalty

REWARDS: dict[str, type] = {
    "correctness": MathReward,
    "kv_penalty": KVPenalty,
    "thinking_penalty": ThinkingPenalty,
    "speedup": SpeedupReward,
}


class CompositeReward:
    """``total = sum(weight * term.total)``; the record keeps every term's unweighted total.

    terms: ``{name: (reward, weight)}``. Components are ``{name: term total}``; each term's own
    info is kept as ``{name}/{key}``; ``parsed`` is the first term's parsed answer that is not None.
    """

    def __init__(self, terms: Mapping[str, tuple[Reward, float]]):
        if not terms:
            raise ValueError("CompositeReward needs at least one term")
        self.terms = dict(terms)

    @classmethod
    def from_config(cls, config: Mapping[str, float | Mapping]) -> CompositeReward:
        """Build from ``{name: weight}`` or ``{name: {"weight": w, "type": kind, **kwargs}}``.

        ``type`` defaults to the name and picks the class from ``REWARDS``; the other keys are its
        constructor arguments; ``weight`` defaults to 1.0. Example:
        ``{"correctness": 1.0, "kv_penalty": {"budget": 2048, "coef": 0.5}}``.
        """
        return cls({name: _build_term(name, spec) for name, spec in config.items()})

    def __call__(self, sample: RewardInput) -> RewardRecord:
        return self.score(sample)

    def score(self, sample: RewardInput) -> RewardRecord:
        total, components, info, parsed = 0.0, {}, {}, None
        for name, (reward, weight) in self.terms.items():
            record = reward.score(sample)
            total += weight * record.total
            components[name] = record.total
            info.update({f"{name}/{k}": v for k, v in record.info.items()})
            parsed = parsed if parsed is not None else record.parsed
        return RewardRecord(total, components, parsed, info)


def _build_term(name: str, spec: float | Mapping) -> tuple[Reward, float]:
    if isinstance(spec, (int, float)) and not isinstance(spec, bool):
        spec = {"weight": float(spec)}
    if not isinstance(spec, Mapping):
        raise ValueError(f"reward term {name!r} must be a weight or a mapping, got {spec!r}")
    kwargs = dict(spec)
    weight = float(kwargs.pop("weight", 1.0))
    kind = kwargs.pop("type", name)
    if kind not in REWARDS:
        raise ValueError(f"unknown reward {kind!r} for term {name!r}; valid: {', '.join(sorted(REWARDS))}")
    cls = REWARDS[kind]
    accepted = set(inspect.signature(cls.__init__).parameters) - {"self"}
    unknown = set(kwargs) - accepted
    if unknown:
        valid = f"{sorted(accepted)} and weight, type"
        raise ValueError(f"reward {kind!r} got unknown option(s) {sorted(unknown)}; valid: {valid}")
    try:
        return cls(**kwargs), weight
    except TypeError as exc:
        raise ValueError(f"reward {kind!r} for term {name!r}: {exc}") from None
