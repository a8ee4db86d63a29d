"""``eval.compare`` (``sliderl eval COMPARE.yaml``): the entries to compare and how each is sampled.

An entry with ``budget_of`` is a template: once the entry it names has been measured it expands into one entry
per fraction in ``budgets`` (``cluster.eval.comparison``). The budget enters the KV spec through placeholders:
``{budget}`` becomes the budget and ``{budget-N}`` the budget minus N.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import Field, model_validator

from sliderl.cluster.config.base import Section, run_folder
from sliderl.core.kv_policy import KVPolicy

BUDGET = re.compile(r"\{budget(?:-(\d+))?\}")

PROBE_BUDGET = 1 << 20  # a budget large enough that any {budget-N} stays positive when checking a template's syntax


def fill_budget(template: str, budget: int) -> str:
    """``template`` with ``{budget}`` replaced by ``budget`` and ``{budget-N}`` by ``budget - N``."""
    return BUDGET.sub(lambda m: str(budget - int(m.group(1) or 0)), template)


def budget_label(label: str, fraction: float, metric: str = "mean_live_kv") -> str:
    """A template's expanded label: ``label@25%``, or ``label@100% of peak`` for a budget of the peak live KV."""
    return f"{label}@{100 * fraction:g}%" + (" of peak" if metric == "peak_live_kv" else "")


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
    budget_metric: Literal["mean_live_kv", "peak_live_kv"] = "mean_live_kv"
    """What of the reference the budgets are fractions of: its mean live KV (averaged over completions) or its
    peak (the most any completion held; labels then read ``label@100% of peak``)."""

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
        return ([budget_label(self.label, f, self.budget_metric) for f in self.budgets] if self.budgets
                else [self.label])


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
