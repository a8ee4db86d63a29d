"""The records that cross a boundary between the run's processes (or between the driver and its observers),
each defined once: a prompt group goes driver -> rollout worker, a rollout group worker -> trace queue ->
driver -> learner, a worker status worker -> driver, eval results worker -> driver, and a step report
driver -> monitor, metrics.jsonl and W&B. ``docs/architecture.md`` names each in its table of boundaries.

``StepReport``'s field names are the metric names: ``as_dict`` writes them to metrics.jsonl and W&B, and
the ``Monitor`` reads its progress bar, plots and summary through ``KEYS`` (``KEYS.reward == "reward"``,
a misspelt name is an AttributeError), so no second list of names exists.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from sliderl.core.trace import Trace
from sliderl.trainer.metrics import StepMetrics


@dataclass(frozen=True)
class Problem:
    """One dataset row: a stable id, the prompt sent to the engine, the reference answer."""

    prompt_id: str
    prompt: str
    answer: str
    prompt_token_ids: tuple[int, ...] | None = None  # the formatted prompt's ids; None: the engine tokenizes prompt
    baseline_tokens: int | None = None  # Baseline-SFT's response length (reward.speedup; cluster.actors.baseline)

    @property
    def engine_prompt(self) -> list[int] | str:
        """What ``LLM.add_request`` gets: the token ids when the prompt was formatted, else its text."""
        return list(self.prompt_token_ids) if self.prompt_token_ids is not None else self.prompt


@dataclass(frozen=True)
class PromptGroup:
    """Work for a rollout worker: sample ``group_size`` completions of one problem.

    group_id is unique in the run and stable across re-issues; seed is the base sampling seed
    (sample j uses seed + j), so a re-issued group samples the same tokens under the same weights.
    """

    group_id: str
    problem: Problem
    group_size: int
    seed: int


@dataclass
class RolloutGroup:
    """The unit that crosses the trace queue: all samples of one prompt, scored."""

    group_id: str
    worker_id: int
    incarnation: str
    policy_version: int  # weights version when the group's samples started
    traces: list[Trace]
    generate_seconds: float = 0.0

    @property
    def num_tokens(self) -> int:
        return sum(t.num_tokens for t in self.traces)


@dataclass
class WorkerStatus:
    """A worker's answer to the driver's health check."""

    worker_id: int
    incarnation: str  # new after every restart of the process
    pid: int
    version: int
    held_group_ids: list[str]
    fenced: bool = False  # restarted and waiting for weights; refuses work until then
    error: str | None = None  # the engine or scorer thread died with this traceback


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


@dataclass(frozen=True)
class StepReport:
    """The metrics of one optimizer step, as the driver logs them."""

    reward: float
    """mean reward of the traces trained at this step"""
    accuracy: float
    """fraction of those traces the verifier scored correct (correctness component >= 1)"""
    visible_kv: float
    """mean over those traces of their mean visible KV tokens per decode step"""
    peak_visible_kv: float
    """mean over those traces of their peak visible KV tokens (the most any decode step saw)"""
    completion_tokens: float
    """mean generated tokens per trained trace"""
    rollout_tokens_per_s: float
    """generated tokens per second since the previous step, all rollout workers together"""
    stale_groups_dropped: int
    """groups dropped as too stale (or from a newer version) since the previous step"""
    staleness_mean: float
    """mean age in policy versions of the trained groups when training started"""
    staleness_max: int
    """largest such age"""
    queue_depth: int
    """groups waiting in the trace queue after the step"""
    version: int
    """learner policy version after the step"""
    worker_restarts: int
    """rollout worker restarts so far in the run"""
    duplicate_groups: int
    """groups that arrived twice so far (never trained twice)"""
    reissued_groups: int
    """groups re-issued so far after their worker died or restarted"""
    learner_step_seconds: float
    """wall seconds of the learner step"""
    weight_sync_seconds: float | None = None
    """wall seconds of the weight sync after the step; None when no sync was due"""
    memory_release_seconds: float | None = None
    """rollout.release_between_steps: seconds the workers took to free their KV pools before the learner step
    and to allocate them again after the weight sync; None when they keep them"""
    preempted_traces: float = 0.0
    """fraction of the trained traces the engine preempted at least once (its blocks taken back, recomputed
    later): more was in flight than the KV pool holds (``full`` attention's KV grows with the trace)"""
    learner_restarts: int = 0
    """learner (group) restarts from a checkpoint so far in the run"""
    prompt_tokens: float | None = None
    """mean prompt tokens of the trained traces (the reference line of visible_kv.png)"""
    speedup: float | None = None
    """geometric mean of the trained traces' theoretical speedup (reward.speedup); None without that term"""
    trained_groups: int | None = None
    """groups trained at this step (the summary's share of arrived groups dropped as stale)"""
    kv_token_steps: float | None = None
    """mean over the trained traces of their KV-token-steps (the sum over generated tokens of the KV tokens their
    query saw)"""
    restarts: float | None = None
    """mean restarts per trained trace (last_k, summary: the context restarted when its generated part reached N)"""
    reencoded_tokens: float | None = None
    """mean tokens per trained trace encoded again at its restarts (the kept tokens, the summary and its template)"""
    max_token_seconds: float | None = None
    """mean over the trained traces of their longest wait for one token (a restart's re-prefill spike)"""
    learner: StepMetrics | None = None
    """the learner's own metrics (loss, grad_norm, ...), logged as learner/<name> (its version is ``version``)"""
    eval_before: EvalResult | None = None
    """the evaluation before training, on the first step only"""
    eval_after: EvalResult | None = None
    """the evaluation after training, on the last step only"""

    def as_dict(self) -> dict[str, float]:
        """Flat ``{name: number}`` for metrics.jsonl and W&B: each scalar field under its name,
        ``learner/<name>`` for the learner's metrics, ``eval_before/<name>`` and ``eval_after/<name>``
        for an evaluation; None (not measured at this step) is left out."""
        flat: dict[str, float] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, StepMetrics):
                flat.update({f"{f.name}/{k}": v for k, v in value.as_dict().items() if k != "version"})
            elif hasattr(value, "as_metrics"):
                flat.update(value.as_metrics(f.name))
            elif value is not None:
                flat[f.name] = value
        return flat


class _Keys:
    """``KEYS.<field>`` is the metric name of that field of ``StepReport``; unknown names raise."""

    def __init__(self, record: type):
        self._names = frozenset(f.name for f in fields(record))

    def __getattr__(self, name: str) -> str:
        if name.startswith("_") or name not in self._names:
            raise AttributeError(f"StepReport has no metric {name!r}; its metrics are {sorted(self._names)}")
        return name

KEYS = _Keys(StepReport)
