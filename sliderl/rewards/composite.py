"""A weighted sum of reward terms (built from typed settings by ``rewards.spec.RewardSpec``)."""

from __future__ import annotations

from collections.abc import Mapping

from sliderl.rewards.record import Reward, RewardInput, RewardRecord


class CompositeReward:
    """``total = sum(weight * term.total)``; the record keeps every term's unweighted total.

    terms: ``{name: (reward, weight)}``. Components are ``{name: term total}``; each term's own
    info is kept as ``{name}/{key}``; ``parsed`` is the first term's parsed answer that is not None.
    """

    def __init__(self, terms: Mapping[str, tuple[Reward, float]]):
        if not terms:
            raise ValueError("CompositeReward needs at least one term")
        self.terms = dict(terms)

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
