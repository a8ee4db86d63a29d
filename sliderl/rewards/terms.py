"""Cost-side reward terms: TIP's KV-cache penalty, a thinking-length penalty, a penalty on a trace's compute
(KV-token-steps, tokens re-encoded at restarts, restarts) and Pasta's theoretical speedup.

The two penalties share one form, a relative overshoot of a budget:
``-max(0, x - budget) / budget`` (0 within budget, -1 at twice the budget); the term's ``weight`` in the
job's reward (``rewards.spec``) is its one multiplier. The TIP
chapter names a "KV-cache penalty for retaining too many tokens" without giving its formula; this
is our choice for it, with x the trace's mean number of visible KV tokens per decode step (the
thesis' "live KV cache" metric).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from sliderl.core.vocab import END_THINK
from sliderl.rewards.record import RewardInput, RewardRecord


def whitespace_tokens(text: str) -> int:
    """Default token count: whitespace-separated words."""
    return len(text.split())


def budget_overshoot_penalty(value: float, budget: float) -> float:
    """``-max(0, value - budget) / budget``."""
    return -max(0.0, value - budget) / budget


def _check_budget(budget: float, what: str) -> None:
    if not budget > 0:
        raise ValueError(f"{what} budget must be > 0, got {budget}")


class KVPenalty:
    """TIP's KV-cache penalty on the mean visible KV tokens over ``budget`` (see module docstring)."""

    name = "kv_penalty"

    def __init__(self, budget: float):
        _check_budget(budget, "KVPenalty")
        self.budget = float(budget)

    def __call__(self, mean_visible_kv: float) -> RewardRecord:
        total = budget_overshoot_penalty(mean_visible_kv, self.budget)
        return RewardRecord(total, {self.name: total}, info={"mean_visible_kv": float(mean_visible_kv)})

    def score(self, sample: RewardInput) -> RewardRecord:
        if sample.mean_visible_kv is None:
            raise ValueError("KVPenalty needs the trace's mean visible KV tokens; RewardInput.mean_visible_kv is None")
        return self(sample.mean_visible_kv)


COST_MEASURES = ("kv_token_steps", "reencoded_tokens", "num_restarts")


class CostPenalty:
    """Penalty on one of a trace's costs over ``budget``, same form as ``KVPenalty``: ``measure`` is
    ``kv_token_steps`` (the sum over generated tokens of the KV tokens their query saw), ``reencoded_tokens``
    (tokens encoded again at restarts) or ``num_restarts`` (``RewardInput``'s fields of those names)."""

    name = "cost_penalty"

    def __init__(self, measure: str, budget: float):
        if measure not in COST_MEASURES:
            raise ValueError(f"unknown cost measure {measure!r}; valid: {', '.join(COST_MEASURES)}")
        _check_budget(budget, "CostPenalty")
        self.measure, self.budget = measure, float(budget)

    def __call__(self, value: float) -> RewardRecord:
        total = budget_overshoot_penalty(value, self.budget)
        return RewardRecord(total, {self.name: total}, info={self.measure: float(value)})

    def score(self, sample: RewardInput) -> RewardRecord:
        value = getattr(sample, self.measure)
        if value is None:
            raise ValueError(f"CostPenalty needs the trace's {self.measure}; RewardInput.{self.measure} is None")
        return self(value)


class ThinkingPenalty:
    """Penalty on thinking tokens over ``budget``, same form as ``KVPenalty``.

    Thinking tokens are the engine's count when given, else ``count_tokens`` of the text before the
    first ``end_think`` marker (all of the text when the marker never came: thinking never ended).
    """

    name = "thinking_penalty"

    def __init__(
        self,
        budget: float,
        end_think: str = END_THINK,
        count_tokens: Callable[[str], int] = whitespace_tokens,
    ):
        _check_budget(budget, "ThinkingPenalty")
        self.budget = float(budget)
        self.end_think = end_think
        self.count_tokens = count_tokens

    def __call__(self, completion_text: str | None = None, num_thinking_tokens: int | None = None) -> RewardRecord:
        if num_thinking_tokens is None:
            if completion_text is None:
                raise ValueError("ThinkingPenalty needs completion_text or num_thinking_tokens")
            num_thinking_tokens = self.count_tokens(completion_text.partition(self.end_think)[0])
        total = budget_overshoot_penalty(num_thinking_tokens, self.budget)
        return RewardRecord(total, {self.name: total}, info={"thinking_tokens": float(num_thinking_tokens)})

    def score(self, sample: RewardInput) -> RewardRecord:
        return self(sample.completion_text, sample.num_thinking_tokens)


class SpeedupReward:
    """Pasta's theoretical speedup (thesis §3.4): ``baseline_tokens / critical path``.

    ``baseline_tokens`` is Baseline-SFT's response length for the same prompt (``RewardInput.baseline_tokens``;
    ``cluster.actors.baseline`` generates them); the critical path is the response's longest sequential chain
    of decode steps, in tokens, read by ``core.pasta.PastaLayout`` from the flattened token ids and the
    runtime's forced flags — the structure the engine decoded and the trainer trains. A response without
    forks has its own length as critical path. ``tokenizer`` gives the Pasta-Lang tag ids and decodes a
    promise's ``tokens="N"``; ``core.pasta`` (torch) is imported here, on first use.
    """

    name = "speedup"

    def __init__(self, tokenizer):
        from sliderl.core.pasta import PastaTokenIds

        self.tags = PastaTokenIds.from_tokenizer(tokenizer)
        self.decode = tokenizer.decode

    def __call__(self, prompt_len: int, completion_ids: Sequence[int], baseline_tokens: int,
                 forced: Sequence[bool] | None = None) -> RewardRecord:
        from sliderl.core.pasta import PastaLayout

        layout = PastaLayout.parse(prompt_len, completion_ids, self.tags, self.decode, forced)
        speedup = layout.speedup(baseline_tokens)
        info = {
            "critical_path": float(layout.critical_path),
            "num_tokens": float(layout.num_generated),
            "baseline_tokens": float(baseline_tokens),
            "num_forks": float(len(layout.forks)),
            "num_malformed": float(layout.malformed.total),
        }
        return RewardRecord(speedup, {self.name: speedup}, info=info)

    def score(self, sample: RewardInput) -> RewardRecord:
        missing = [name for name in ("prompt_token_ids", "completion_token_ids", "baseline_tokens")
                   if getattr(sample, name) is None]
        if missing:
            raise ValueError(f"SpeedupReward needs the response's token ids and Baseline-SFT's length for its prompt; "
                             f"RewardInput.{', '.join(missing)} is None")
        return self(len(sample.prompt_token_ids), sample.completion_token_ids, sample.baseline_tokens, sample.forced)
