"""Accuracy of a policy on eval problems, with the KV numbers of the completions that produced it.

``score`` turns one completion per problem into an ``EvalResult``; the driver gets outputs from a
rollout worker (before and after training), ``sliderl eval CHECKPOINT`` from an engine in its own
process. ``score_samples`` turns k sampled completions per problem into a ``SampledEval`` — avg@k,
pass@k, what the samples cost and each one's critical path — for ``sliderl eval COMPARE.yaml``
(``cluster.eval.comparison``), which turns critical paths into Pasta's theoretical speedup over a baseline entry
(``geomean_speedup``).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace

from sliderl.cluster.records import EvalResult, Problem
from sliderl.rewards import RewardInput


def score(outputs: list, problems: list[Problem], verifier, kv_policy: str,
          rows: list[dict] | None = None) -> EvalResult:
    """``outputs[i]`` (a RequestOutput) answers ``problems[i]``; ``verifier.score(RewardInput)``. ``rows``, when
    given, receives one dict per problem (prompt_id, answer, completion, tokens, correct), for the run's files."""
    if len(outputs) != len(problems) or not problems:
        raise ValueError(f"got {len(outputs)} outputs for {len(problems)} problems; need one per problem, at least one")
    hits = [verifier.score(RewardInput(o.text, p.answer)).total >= 1.0 for o, p in zip(outputs, problems)]
    if rows is not None:
        rows.extend({"prompt_id": p.prompt_id, "answer": p.answer, "completion": o.text, "tokens": len(o.token_ids),
                     "correct": hit} for o, p, hit in zip(outputs, problems, hits))
    correct = sum(hits)
    n = len(problems)
    return EvalResult(
        num_problems=n,
        accuracy=correct / n,
        mean_tokens=sum(len(o.token_ids) for o in outputs) / n,
        mean_visible_kv=sum(o.kv.mean_visible_tokens for o in outputs) / n,
        peak_visible_kv=max(o.kv.peak_visible_tokens for o in outputs),
        kv_policy=kv_policy,
    )


# ------------------------------------------------------------------------------ k samples per problem


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k estimate from ``n`` samples of which ``c`` are correct: the chance that k of
    them drawn without replacement hold at least one correct, ``1 - C(n-c, k) / C(n, k)`` (k <= n)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def avg_at_k(correct: list[list[bool]]) -> float:
    """Mean over problems of the fraction of a problem's samples that are correct (``correct[i][j]``:
    sample j of problem i)."""
    return sum(sum(row) / len(row) for row in correct) / len(correct)


def mean_pass_at_k(correct: list[list[bool]], k: int) -> float:
    """Mean over problems of ``pass_at_k(n, c, k)``, n the problem's samples and c its correct ones."""
    return sum(pass_at_k(len(row), sum(row), k) for row in correct) / len(correct)


@dataclass(frozen=True)
class SampledEval:
    """One policy sampled ``k`` times per problem: its accuracy (TIP's avg@k and pass@k) and its cost."""

    num_problems: int
    k: int
    avg_at_k: float  # mean over problems of the fraction of correct samples
    pass_at_k: float  # mean over problems of 1 - C(k-c, k)/C(k, k): the fraction with a correct sample
    mean_live_kv: float  # mean over completions of their mean visible KV tokens per decode step
    peak_live_kv: int  # largest visible KV of any completion at any step
    generated_tokens: int  # all completions together
    decode_seconds: float  # wall seconds of the one generate call that produced every completion
    tokens_per_second: float  # generated_tokens / decode_seconds: the batch's aggregate throughput
    lengths: tuple[int, ...] = field(default=(), repr=False)  # each sample's completion tokens (i * k + j)
    critical_paths: tuple[int, ...] = field(default=(), repr=False)  # each sample's longest sequential chain
    speedup: float | None = None  # geometric mean theoretical speedup over a baseline entry (``with_speedup``)
    kv_token_steps: float = 0.0  # mean over completions of their KV-token-steps: the live KV summed over the
    # generation (a completion's memory x time; rows written before this field read 0)

    @property
    def mean_critical_path(self) -> float:
        """Mean over samples of their critical paths (tokens)."""
        return statistics.fmean(self.critical_paths) if self.critical_paths else 0.0

    def summary(self) -> dict:
        """The scalar fields (the per-sample tuples left out)."""
        return {k: v for k, v in asdict(self).items() if not isinstance(v, (tuple, list))}

    def with_speedup(self, baseline: SampledEval) -> SampledEval:
        """This run with Pasta's theoretical speedup over ``baseline`` (the same problems, k and seed): each
        sample's speedup is the baseline's mean response length on its problem over the sample's critical
        path; their geometric mean (thesis §3.5)."""
        if baseline.num_problems != self.num_problems or not baseline.lengths or not self.critical_paths:
            raise ValueError(f"a speedup needs the baseline's lengths on the same {self.num_problems} problems")
        per_problem = [statistics.fmean(baseline.lengths[i * baseline.k:(i + 1) * baseline.k])
                       for i in range(baseline.num_problems)]
        ratios = [per_problem[n // self.k] / cp for n, cp in enumerate(self.critical_paths)]
        return replace(self, speedup=math.exp(statistics.fmean(math.log(r) for r in ratios)))


def response_length(output) -> int:
    """A response's critical path when nothing runs in parallel: its length."""
    return len(output.token_ids)


def pasta_critical_path(tokenizer) -> Callable[[object], int]:
    """A kv=pasta response's critical path (``core.pasta.PastaLayout`` of its flattened token ids and forced
    flags: the structure the runtime decoded)."""
    from sliderl.core.pasta import PastaLayout, PastaTokenIds

    tags = PastaTokenIds.from_tokenizer(tokenizer)
    return lambda out: PastaLayout.parse(len(out.prompt_token_ids), out.token_ids, tags, tokenizer.decode,
                                         out.forced).critical_path


def pd_critical_path(output) -> int:
    """A kv=planned_diffusion response's sequential forward passes (``rollout.planned_diffusion``'s ``PDOutput``:
    autoregressive steps, denoising forwards, one commit per round)."""
    return output.planned_diffusion.forward_passes


def critical_path_of(kv: str, tokenizer) -> Callable[[object], int]:
    """How a response's critical path is read under the KV policy ``kv`` (its spec)."""
    if kv == "pasta":
        return pasta_critical_path(tokenizer)
    return pd_critical_path if kv == "planned_diffusion" else response_length


def score_samples(outputs: list, problems: list[Problem], k: int, verifier, decode_seconds: float,
                  critical_path: Callable[[object], int] = response_length) -> SampledEval:
    """``outputs[i * k + j]`` (a RequestOutput) is sample j of ``problems[i]``; ``verifier.score(RewardInput)``;
    ``critical_path(output)`` in tokens (``pasta_critical_path`` for kv=pasta, ``pd_critical_path`` for
    kv=planned_diffusion, else the length)."""
    if not problems or k < 1 or len(outputs) != k * len(problems):
        raise ValueError(f"got {len(outputs)} outputs for {len(problems)} problems x k={k}; need k >= 1 per "
                         "problem, at least one problem")
    correct = [[verifier.score(RewardInput(o.text, p.answer)).total >= 1.0 for o in outputs[i * k:(i + 1) * k]]
               for i, p in enumerate(problems)]
    tokens = sum(len(o.token_ids) for o in outputs)
    return SampledEval(
        num_problems=len(problems),
        k=k,
        avg_at_k=avg_at_k(correct),
        pass_at_k=mean_pass_at_k(correct, k),
        mean_live_kv=sum(o.kv.mean_visible_tokens for o in outputs) / len(outputs),
        peak_live_kv=max(o.kv.peak_visible_tokens for o in outputs),
        generated_tokens=tokens,
        decode_seconds=decode_seconds,
        tokens_per_second=tokens / decode_seconds if decode_seconds > 0 else 0.0,
        lengths=tuple(len(o.token_ids) for o in outputs),
        critical_paths=tuple(critical_path(o) for o in outputs),
        kv_token_steps=sum(o.kv.token_steps for o in outputs) / len(outputs),
    )
