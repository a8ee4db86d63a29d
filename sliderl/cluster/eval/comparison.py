"""``sliderl eval COMPARE.yaml``: several (checkpoint, KV policy) entries sampled k times per problem.

The entries come from ``eval.compare`` (``CompareConfig``). An entry with ``budget_of`` is a
template: it expands, once the entry it names has been measured, into one entry per fraction in
``budgets``, with budget = round-half-up(fraction x the reference's mean live KV tokens, averaged
over seeds), at least 1. The budget enters the KV spec through placeholders, so any policy
``core.kv_policy.KVPolicy.parse`` accepts can be budgeted:

- ``{budget}`` becomes the budget: ``h2o:{budget}`` (B = budget), ``sliding_window:{budget}``;
- ``{budget-N}`` becomes the budget minus N: ``streaming:4:{budget-4}`` keeps 4 sinks and a
  window of budget - 4, so sinks + window = the budget.

Every entry samples the same problems with the same per-request seeds (seed s, problem i, sample
j: ``s * 2**32 + i * k + j``), so entries differ only by weights and KV policy. Each seed's samples
are one ``generate`` call, timed: its wall seconds are the decode time, generated tokens over them
the aggregate throughput; each engine first completes one short untimed request.

With ``speedup_of`` (Pasta's evaluation) every entry also gets the theoretical speedup over that entry:
per sample, the baseline's mean response length on the problem (same seed) over the sample's critical
path — a ``kv=pasta`` response's longest sequential chain (``core.pasta.PastaLayout``), a
``kv=planned_diffusion`` response's sequential forward passes, any other's length — and the geometric mean over
samples (thesis §3.5; ``SampledEval.with_speedup``).
"""

from __future__ import annotations

import dataclasses
import statistics
import time

from sliderl.cluster.config.compare import CompareEntry, budget_label, fill_budget
from sliderl.cluster.eval.evaluation import SampledEval, critical_path_of, score_samples
from sliderl.core.kv_policy import KVPolicy

WARMUP_TOKENS = 4  # an untimed request per engine first, so decode time leaves out lazy set-up (CUDA graphs)
SEED_STRIDE = 1 << 32  # sample seeds of eval seed s: s * SEED_STRIDE + i * k + j


# ------------------------------------------------------------------------------------- results


@dataclasses.dataclass(frozen=True)
class EntryResult:
    """One expanded entry's runs, one ``SampledEval`` per seed."""

    label: str
    checkpoint: str
    kv: str  # the concrete spec the engine ran
    runs: tuple[SampledEval, ...]
    seeds: tuple[int, ...]
    budget_of: str | None = None
    fraction: float | None = None
    budget: int | None = None  # round-half-up(fraction x the reference's mean live KV)

    def mean(self, metric: str) -> float:
        return statistics.fmean(getattr(r, metric) for r in self.runs)

    def std(self, metric: str) -> float:
        """Sample standard deviation over seeds (0 with one seed)."""
        values = [getattr(r, metric) for r in self.runs]
        return statistics.stdev(values) if len(values) > 1 else 0.0


@dataclasses.dataclass(frozen=True)
class PlannedEntry:
    """An entry ready to run: a label, resolved weights and a concrete KV spec (plus its budget origin)."""

    label: str
    checkpoint: str
    kv: str
    budget_of: str | None = None
    fraction: float | None = None
    budget: int | None = None


def expand(entry: CompareEntry, checkpoint: str, reference: EntryResult,
           block_size: int | None = None) -> list[PlannedEntry]:
    """A template entry's concrete entries, budgeted from ``reference``'s measured mean (or peak) live KV; with
    ``block_size`` (the engine's), an h2o budget below two pages is refused here too, before its engine starts."""
    planned, metric = [], entry.budget_metric
    what = "mean" if metric == "mean_live_kv" else "peak"
    for fraction in entry.budgets:
        budget = max(1, int(fraction * reference.mean(metric) + 0.5))
        spec = fill_budget(entry.kv, budget)
        try:
            policy = KVPolicy.parse(spec)
            if policy.kind == "h2o" and block_size is not None:
                policy.budget_pages(block_size)
            kv = policy.spec
        except ValueError as err:
            raise ValueError(f"entry {entry.label!r} at {fraction:g} x {reference.label}'s {what} live KV "
                             f"({reference.mean(metric):.1f}) has budget {budget}, giving {spec!r}: {err}; "
                             "raise the fraction") from None
        planned.append(PlannedEntry(budget_label(entry.label, fraction, metric), checkpoint, kv, reference.label,
                                    fraction, budget))
    return planned


def run_comparison(cfg, checkpoints: dict[str, str], problems: list, verifier, report=print) -> list[EntryResult]:
    """Every entry of ``cfg.eval.compare`` (plain ones first, then the expanded templates), in order.

    ``checkpoints[label]`` is each entry's resolved model directory; ``report(line)`` is told of each
    finished entry.
    """
    compare = cfg.eval.compare
    results: dict[str, EntryResult] = {}
    for entry in (e for e in compare.entries if e.budget_of is None):
        results[entry.label] = run_entry(cfg, PlannedEntry(entry.label, checkpoints[entry.label],
                                                           KVPolicy.parse(entry.kv).spec), problems, verifier)
        report(results[entry.label])
    for entry in (e for e in compare.entries if e.budget_of is not None):
        for planned in expand(entry, checkpoints[entry.label], results[entry.budget_of], cfg.engine.block_size):
            results[planned.label] = run_entry(cfg, planned, problems, verifier)
            report(results[planned.label])
    if compare.speedup_of is not None:
        baseline = results[compare.speedup_of]
        results = {label: dataclasses.replace(r, runs=tuple(run.with_speedup(base) for run, base in
                                                            zip(r.runs, baseline.runs)))
                   for label, r in results.items()}
    return list(results.values())


def run_entry(cfg, planned: PlannedEntry, problems: list, verifier) -> EntryResult:
    """Sample every problem k times under ``planned``'s weights and KV policy, once per seed; prompts are
    written by ``cfg.data`` with the checkpoint's own tokenizer."""
    from sliderl.cluster.config.prompts import prompt_format
    from sliderl.rollout import LLM

    compare = cfg.eval.compare
    runs = []
    with LLM(planned.checkpoint, args=dataclasses.replace(cfg.engine, kv=planned.kv)) as llm:
        written = prompt_format(cfg.data, cfg.model, llm.tokenizer).apply(problems)
        prompts = [p.engine_prompt for p in written for _ in range(compare.k)]
        critical_path = critical_path_of(planned.kv, llm.tokenizer)
        llm.generate(prompts[:1], dataclasses.replace(sample_params(cfg), max_tokens=WARMUP_TOKENS))  # untimed
        for seed in compare.seeds:
            params = [sample_params(cfg).for_sample(i, base_seed=seed * SEED_STRIDE) for i in range(len(prompts))]
            start = time.perf_counter()
            outputs = llm.generate(prompts, params)
            runs.append(score_samples(outputs, problems, compare.k, verifier, time.perf_counter() - start,
                                      critical_path))
    return EntryResult(planned.label, planned.checkpoint, planned.kv, tuple(runs), tuple(compare.seeds),
                       planned.budget_of, planned.fraction, planned.budget)


def sample_params(cfg):
    """The comparison's sampling: the rollout settings with eval.compare's temperature, top-p and length."""
    compare = cfg.eval.compare
    return dataclasses.replace(cfg.sampling, temperature=compare.temperature, top_p=compare.top_p, seed=None,
                               max_tokens=compare.max_tokens or cfg.eval.max_tokens or cfg.sampling.max_tokens)


__all__ = ["EntryResult", "PlannedEntry", "expand", "run_comparison"]
