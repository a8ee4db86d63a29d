"""``sliderl eval COMPARE.yaml``: several (checkpoint, KV policy) entries sampled k times per problem.

The entries come from ``eval.compare`` (``CompareConfig``). An entry with ``budget_of`` is a
template: it expands, once the entry it names has been measured, into one entry per fraction in
``budgets``, with budget = round-half-up(fraction x the reference's mean live KV tokens, averaged
over seeds), at least 1. The budget enters the KV spec through placeholders, so any policy
``rollout.kv_policy.KVPolicy.parse`` accepts can be budgeted:

- ``{budget}`` becomes the budget: ``h2o:{budget}`` (B = budget), ``sliding_window:{budget}``;
- ``{budget-N}`` becomes the budget minus N: ``streaming:4:{budget-4}`` keeps 4 sinks and a
  window of budget - 4, so sinks + window = the budget.

Every entry samples the same problems with the same per-request seeds (seed s, problem i, sample
j: ``s * 2**32 + i * k + j``), so entries differ only by weights and KV policy. Each seed's samples
are one ``generate`` call, timed: its wall seconds are the decode time, generated tokens over them
the aggregate throughput; each engine first completes one short untimed request.

With ``speedup_of`` (Pasta's evaluation) every entry also gets the theoretical speedup over that entry:
per sample, the baseline's mean response length on the problem (same seed) over the sample's critical
path — a ``kv=pasta`` response's longest sequential chain (``rollout.pasta.PastaLayout``), any other's
length — and the geometric mean over samples (thesis §3.5; ``SampledEval.with_speedup``).
"""

from __future__ import annotations

import dataclasses
import re
import statistics
import time
from typing import Annotated

from pydantic import Field, model_validator

from sliderl.cluster.config import Section, run_folder
from sliderl.cluster.evaluation import SampledEval, pasta_critical_path, response_length, score_samples
from sliderl.rollout.kv_policy import KVPolicy

BUDGET = re.compile(r"\{budget(?:-(\d+))?\}")
PROBE_BUDGET = 1 << 20  # a budget large enough that any {budget-N} stays positive when checking a template's syntax
WARMUP_TOKENS = 4  # an untimed request per engine first, so decode time leaves out lazy set-up (CUDA graphs)
SEED_STRIDE = 1 << 32  # sample seeds of eval seed s: s * SEED_STRIDE + i * k + j


def fill_budget(template: str, budget: int) -> str:
    """``template`` with ``{budget}`` replaced by ``budget`` and ``{budget-N}`` by ``budget - N``."""
    return BUDGET.sub(lambda m: str(budget - int(m.group(1) or 0)), template)


def budget_label(label: str, fraction: float) -> str:
    """The label of a template entry expanded at ``fraction``: ``StreamingLLM@25%``."""
    return f"{label}@{100 * fraction:g}%"


# -------------------------------------------------------------------------------------- config


class CompareEntry(Section):
    """One line of the comparison: weights and a KV policy, or a template budgeted from another entry."""

    label: str = Field(min_length=1)
    """Name in the table and the plots (template entries get ``label@25%`` etc.)."""
    checkpoint: str | None = None
    """A Hugging Face model directory (e.g. run_dir/checkpoints/step_000120); None uses the config's ``model``."""
    kv: str = "full"
    """KV policy spec; with ``budgets``, a template holding ``{budget}`` or ``{budget-N}``
    (e.g. ``streaming:4:{budget-4}``, ``h2o:{budget}``)."""
    budget_of: str | None = None
    """Label of the entry whose measured mean live KV the budgets are fractions of (itself not a template)."""
    budgets: list[Annotated[float, Field(gt=0)]] = []
    """Fractions (> 0) of the reference's mean live KV, one expanded entry each, e.g. [0.25, 0.5, 1.0]."""

    @model_validator(mode="after")
    def _template_consistent(self) -> CompareEntry:
        templated = BUDGET.search(self.kv) is not None
        if (self.budget_of is None) != (not self.budgets):
            raise ValueError(f"entry {self.label!r}: budget_of and budgets go together (got budget_of="
                             f"{self.budget_of!r}, budgets={self.budgets})")
        if templated != bool(self.budgets):
            raise ValueError(f"entry {self.label!r}: kv {self.kv!r} " + (
                "holds a {budget} placeholder but the entry has no budgets/budget_of" if templated else
                "needs a {budget} or {budget-N} placeholder where the budget goes, e.g. streaming:4:{budget-4}"))
        KVPolicy.parse(fill_budget(self.kv, PROBE_BUDGET))  # a bad spec is an error before any engine starts
        return self

    def expanded_labels(self) -> list[str]:
        return [budget_label(self.label, f) for f in self.budgets] if self.budgets else [self.label]


class CompareConfig(Section):
    """``sliderl eval COMPARE.yaml``: entries sampled k times per problem on the first eval.num_problems
    eval problems (TIP's evaluation: avg@k, pass@k, live KV, throughput, decode time)."""

    entries: list[CompareEntry] = []
    """The entries to compare, each {label, checkpoint, kv} or a budget template {label, checkpoint, kv,
    budget_of, budgets}; run in order, templates after the entries they reference."""
    k: int = Field(8, ge=1)
    """Samples per problem (avg@k and pass@k use all of them)."""
    temperature: float = Field(0.6, ge=0)
    """Sampling temperature of every sample (0: greedy, so the k samples coincide)."""
    top_p: float = Field(0.95, gt=0, le=1)
    """Nucleus mass of every sample (1: off)."""
    seeds: list[Annotated[int, Field(ge=0, lt=1 << 31)]] = Field(default_factory=lambda: [0], min_length=1)
    """Sampling seeds: every entry runs once per seed; more than one reports mean ± std over seeds."""
    max_tokens: int | None = Field(None, ge=1)
    """Longest completion; None uses eval.max_tokens, then sampling.max_tokens."""
    speedup_of: str | None = None
    """Label of the sequential baseline entry (Pasta: Baseline-SFT): adds every entry's geometric-mean theoretical
    speedup over it (its mean length on the problem / the sample's critical path) and a quality-vs-speedup plot."""
    output_dir: str = Field(default_factory=run_folder("eval"))
    """Where results.md, results.jsonl, config.yaml and the Pareto plots (PNG) are written."""

    @model_validator(mode="after")
    def _references_known(self) -> CompareConfig:
        if len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"seeds must be distinct, got {self.seeds}")
        plain = {e.label for e in self.entries if e.budget_of is None}
        if self.speedup_of is not None and self.speedup_of not in plain:
            raise ValueError(f"speedup_of {self.speedup_of!r} names no entry without a budget; plain entries: "
                             f"{', '.join(sorted(plain)) or 'none'}")
        for entry in self.entries:
            if entry.budget_of is not None and entry.budget_of not in plain:
                templated = any(e.label == entry.budget_of for e in self.entries)
                raise ValueError(f"entry {entry.label!r}: budget_of {entry.budget_of!r} " + (
                    "is itself a budget template; " if templated else "names no entry without a budget; ")
                    + f"plain entries: {', '.join(sorted(plain)) or 'none'}")
        labels = [label for e in self.entries for label in e.expanded_labels()]
        repeated = sorted({label for label in labels if labels.count(label) > 1})
        if repeated:
            raise ValueError(f"entry labels must be distinct (after expanding budgets), repeated: {', '.join(repeated)}")
        return self


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


def expand(entry: CompareEntry, checkpoint: str, reference: EntryResult) -> list[PlannedEntry]:
    """A template entry's concrete entries, budgeted from ``reference``'s measured mean live KV."""
    planned = []
    for fraction in entry.budgets:
        budget = max(1, int(fraction * reference.mean("mean_live_kv") + 0.5))
        spec = fill_budget(entry.kv, budget)
        try:
            kv = KVPolicy.parse(spec).spec
        except ValueError as err:
            raise ValueError(f"entry {entry.label!r} at {fraction:g} x {reference.label}'s mean live KV "
                             f"({reference.mean('mean_live_kv'):.1f}) has budget {budget}, giving {spec!r}: {err}; "
                             "raise the fraction") from None
        planned.append(PlannedEntry(budget_label(entry.label, fraction), checkpoint, kv, reference.label, fraction,
                                    budget))
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
        for planned in expand(entry, checkpoints[entry.label], results[entry.budget_of]):
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
    from sliderl.cluster.prompts import prompt_format
    from sliderl.rollout import LLM

    compare = cfg.eval.compare
    runs = []
    with LLM(planned.checkpoint, args=dataclasses.replace(cfg.engine, kv=planned.kv)) as llm:
        written = prompt_format(cfg.data, cfg.model, llm.tokenizer).apply(problems)
        prompts = [p.engine_prompt for p in written for _ in range(compare.k)]
        critical_path = pasta_critical_path(llm.tokenizer) if planned.kv == "pasta" else response_length
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


__all__ = ["CompareConfig", "CompareEntry", "EntryResult", "PlannedEntry", "expand", "fill_budget", "run_comparison"]
