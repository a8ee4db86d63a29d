"""The records every reward reads and returns: ``RewardInput`` in, ``RewardRecord`` out."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class RewardInput:
    """What a reward may look at for one completion.

    completion_text: the decoded completion (special tokens such as ``</think>`` kept).
    answer: the task's reference answer (math tasks), else None.
    mean_visible_kv: the trace's mean number of KV tokens visible per decode step (engine stats).
    num_thinking_tokens: tokens before the end-of-thinking marker, when the engine counted them.
    prompt_token_ids, completion_token_ids, forced: the engine's prompt, completion (under ``kv=pasta`` the
        flattened response) and forced flags, for terms that read tokens (Pasta's speedup).
    baseline_tokens: Baseline-SFT's response length for this prompt (Pasta's speedup), else None.
    kv_token_steps, reencoded_tokens, num_restarts: the trace's cost (engine stats): the sum over generated tokens
        of the KV tokens their query saw, the tokens encoded again at restarts, the restarts (``last_k``, ``summary``;
        0 under every other policy).
    """

    completion_text: str
    answer: str | None = None
    mean_visible_kv: float | None = None
    num_thinking_tokens: int | None = None
    prompt_token_ids: Sequence[int] | None = None
    completion_token_ids: Sequence[int] | None = None
    forced: Sequence[bool] | None = None
    baseline_tokens: int | None = None
    kv_token_steps: int | None = None
    reencoded_tokens: int | None = None
    num_restarts: int | None = None


@dataclass(frozen=True)
class RewardRecord:
    """One completion's reward: ``total`` and the named parts it was made of.

    components: reward terms (the values that were summed, before any composite weight).
    parsed: the extracted final answer, when the reward parses one.
    info: diagnostics that are not part of the reward (counts, raw measurements).
    """

    total: float
    components: dict[str, float]
    parsed: str | None = None
    info: dict[str, float] = field(default_factory=dict)

    def as_metrics(self, prefix: str = "reward") -> dict[str, float]:
        """Flat ``{prefix}/total``, ``{prefix}/{component}``, ``{prefix}/{info key}`` floats."""
        metrics = {f"{prefix}/total": float(self.total)}
        metrics.update({f"{prefix}/{k}": float(v) for k, v in self.components.items()})
        metrics.update({f"{prefix}/{k}": float(v) for k, v in self.info.items()})
        return metrics


class Reward(Protocol):
    """Anything that scores a ``RewardInput``; each reward also has a direct ``__call__``."""

    def score(self, sample: RewardInput) -> RewardRecord: ...
