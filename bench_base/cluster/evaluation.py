"""Accuracy of a policy on eval problems, with the KV numbers of the completions that produced it.

``score`` turns engine outputs into an ``EvalResult``; the driver gets outputs from a rollout
worker (before and after training), ``sliderl eval`` from an engine in its own process.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from cluster.data import Problem
from rewards import RewardInput


@dataclass(frozen=True)
class EvalResult:
    """Accuracy (verifier score 1) over ``num_problems`` and what the completions cost."""

    num_problems: int
    accuracy: float
    mean_tokens: float
    mean_visible_kv: float  # mean over completions of their mean visible KV tokens per decode step
    peak_visible_kv: int  # largest over completions
    kv_policy: str

    def as_metrics(self, prefix: str) -> dict[str, float]:
        return {f"{prefix}/{k}": float(v) for k, v in asdict(self).items() if k != "kv_policy"}

    def line(self) -> str:
        return (f"accuracy {self.accuracy:.3f} on {self.num_problems} problems | {self.kv_policy} | "
                f"visible KV mean {self.mean_visible_kv:.1f} peak {self.peak_visible_kv} | "
                f"{self.mean_tokens:.1f} tokens per completion")


def score(outputs: list, problems: list[Problem], verifier, kv_policy: str) -> EvalResult:
    """``outputs[i]`` (a RequestOutput) answers ``problems[i]``; ``verifier.score(RewardInput)``."""
    if len(outputs) != len(problems) or not problems:
        raise ValueError(f"got {len(outputs)} outputs for {len(problems)} problems; need one per problem, at least one")
    correct = sum(verifier.score(RewardInput(o.text, p.answer)).total >= 1.0 for o, p in zip(outputs, problems))
    n = len(problems)
    return EvalResult(
        num_problems=n,
        accuracy=correct / n,
        mean_tokens=sum(len(o.token_ids) for o in outputs) / n,
        mean_visible_kv=sum(o.kv.mean_visible_tokens for o in outputs) / n,
        peak_visible_kv=max(o.kv.peak_visible_tokens for o in outputs),
        kv_policy=kv_policy,
    )


def eval_sampling(sampling: dict, temperature: float, max_tokens: int, seed: int) -> dict:
    """SamplingParams fields for eval: the rollout settings with eval's temperature, length and seed."""
    return {**sampling, "temperature": temperature, "max_tokens": max_tokens, "seed": seed}
