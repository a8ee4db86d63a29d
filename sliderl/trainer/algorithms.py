"""The learner's algorithms (GRPO, BoNBoN, SFT, Planned Diffusion's hybrid objective) as small classes in a registry.

Each algorithm does two things for the ``Learner``:
  ``select(groups) -> Selection``: which traces train, with what advantage or role, which traces
      must share a micro-batch (a BoNBoN pair), and how many groups were skipped and why;
  ``loss(batch, totals) -> LossOutput``: the micro-batch's share of the step's loss, so that
      summing it over micro-batches (gradient accumulation) gives the loss of the whole step.

Rows (one training window of one trace) arrive with recomputed logprobs (with grad), the sampler's
logprobs and a loss mask, all ``[n]`` per row; ``pad`` turns them into the ``[B, T]`` batches that
``trainer.losses`` takes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Literal

import torch
from torch import Tensor

from sliderl.core.trace import Trace
from sliderl.trainer.losses import (
    AGGREGATIONS,
    LossOutput,
    bonbon_beta,
    bonbon_loss,
    group_advantages,
    grpo_loss,
    latency_aware_score,
    planned_diffusion_loss,
    preference_pairs,
    sft_loss,
)

OLD_LOGPROBS = ("sampler", "recomputed")
RECORD_CONFIG: dict[str, Any] = {"extra": "forbid", "use_attribute_docstrings": True}


@dataclass(frozen=True)
class GRPOOptions:
    """GRPO's options (``GRPO``; the loss is ``trainer.losses.grpo_loss``)."""

    __pydantic_config__: ClassVar[dict] = RECORD_CONFIG
    type: Literal["grpo"] = "grpo"
    """The algorithm: grpo."""
    clip_low: float = 0.2
    """Lower PPO clip: ratios below 1 - clip_low are clipped (>= 0)."""
    clip_high: float = 0.28
    """Upper PPO clip: ratios above 1 + clip_high are clipped (>= 0; clip-higher keeps exploration)."""
    tis_cap: float | None = None
    """Truncated importance weight cap on exp(recomputed - sampler) (> 0; needs old_logprobs recomputed); None: off."""
    kl_coef: float = 0.0
    """Weight of the k3 KL to the frozen reference model (>= 0; 0 loads no reference)."""
    aggregation: Literal["token_mean", "seq_mean_token_mean", "constant"] = "token_mean"
    """token_mean: over every loss token of the step; seq_mean_token_mean: each trace's token mean, then
    the mean over traces; constant: the step's sum / constant_norm."""
    constant_norm: float | None = None
    """Divisor of the constant aggregation (> 0; required by it)."""
    scale_by_std: bool = False
    """Divide each group's advantages by its reward standard deviation (+ eps)."""
    eps: float = 1e-6
    """Added to the group's standard deviation when scale_by_std (> 0)."""
    old_logprobs: Literal["sampler", "recomputed"] = "sampler"
    """The ratio's denominator: the sampler's logprobs, or the trainer's own detached (the sampler's then
    feed mismatch_kl and the TIS weight)."""

    def __post_init__(self) -> None:
        _check_type(self, "grpo")
        for name in ("clip_low", "clip_high", "kl_coef"):
            require_field(self, name, getattr(self, name) >= 0, ">= 0")
        require_field(self, "eps", self.eps > 0, "> 0")
        require_field(self, "aggregation", self.aggregation in AGGREGATIONS, f"one of {', '.join(AGGREGATIONS)}")
        require_field(self, "old_logprobs", self.old_logprobs in OLD_LOGPROBS, f"one of {', '.join(OLD_LOGPROBS)}")
        require_field(self, "constant_norm", self.constant_norm is None or self.constant_norm > 0, "> 0 or None")
        if self.aggregation == "constant" and self.constant_norm is None:
            raise ValueError("constant_norm must be > 0 with aggregation='constant', got None")
        require_field(self, "tis_cap", self.tis_cap is None or self.tis_cap > 0, "> 0 or None")
        if self.tis_cap is not None and self.old_logprobs != "recomputed":
            raise ValueError(f"tis_cap must be None unless old_logprobs='recomputed' (it weights by "
                             f"exp(recomputed - sampler)), got {self.tis_cap}")


@dataclass(frozen=True)
class BoNBoNOptions:
    """BoNBoN's options (``BoNBoN``; the loss is ``trainer.losses.bonbon_loss``)."""

    __pydantic_config__: ClassVar[dict] = RECORD_CONFIG
    type: Literal["bonbon"] = "bonbon"
    """The algorithm: bonbon."""
    alpha: float = 0.005
    """Weight of the SFT term on the best sample, in [0, 1]; the IPO term gets 1 - alpha."""
    beta: float | None = None
    """IPO's beta (> 0): the margin target is 1 / (2 beta); None: bonbon_beta(n), n the number of samples the
    pair was picked from (its group: rollout.group_size), the best-vs-worst margin of n samples."""
    quality_weight: float = 1.0
    """λ of the latency-aware score speedup + λ·quality (>= 0; lower ranks more for speed). Quality is the
    quality_key component: correctness, the task's verifier (no LLM judge, unlike the thesis)."""
    speedup_key: str | None = "speedup"
    """Reward component holding the speedup; None scores by quality alone."""
    quality_key: str = "correctness"
    """Reward component holding the quality."""

    def __post_init__(self) -> None:
        _check_type(self, "bonbon")
        require_field(self, "alpha", 0 <= self.alpha <= 1, "in [0, 1]")
        require_field(self, "beta", self.beta is None or self.beta > 0, "> 0 or None")
        require_field(self, "quality_weight", self.quality_weight >= 0, ">= 0")
        require_field(self, "quality_key", bool(self.quality_key), "a reward component name")


@dataclass(frozen=True)
class SFTOptions:
    """SFT has no options: every trace is a target, the loss is the masked token-mean NLL."""

    __pydantic_config__: ClassVar[dict] = RECORD_CONFIG
    type: Literal["sft"] = "sft"
    """The algorithm: sft."""

    def __post_init__(self) -> None:
        _check_type(self, "sft")


@dataclass(frozen=True)
class PlannedDiffusionOptions:
    """Planned Diffusion's options (``PlannedDiffusion``; the loss is ``trainer.losses.planned_diffusion_loss``)."""

    __pydantic_config__: ClassVar[dict] = RECORD_CONFIG
    type: Literal["planned_diffusion"] = "planned_diffusion"
    """The algorithm: planned_diffusion (autoregressive cross-entropy + the masked-diffusion loss on span tokens)."""
    select: Literal["all", "correct"] = "all"
    """all: every trace trains (SFT data: the warm start, sliderl sft); correct: a rollout trains only when its
    reward component quality_key reaches 1 (rejection sampling: the hybrid objective on the policy's own right
    answers, RL without sampler logprobs, which a span's diffusion does not give)."""
    quality_key: str = "correctness"
    """select=correct: the reward component that says a trace is right."""

    def __post_init__(self) -> None:
        _check_type(self, "planned_diffusion")
        require_field(self, "select", self.select in ("all", "correct"), "all or correct")
        require_field(self, "quality_key", bool(self.quality_key), "a reward component name")


AlgorithmOptions = GRPOOptions | BoNBoNOptions | SFTOptions | PlannedDiffusionOptions


def require_field(record, name: str, ok: bool, valid: str) -> None:
    """Raise ``ValueError("<name> must be <valid>, got <value>")`` unless ``ok``: a record's field check."""
    if not ok:
        raise ValueError(f"{name} must be {valid}, got {getattr(record, name)!r}")


def _check_type(record, name: str) -> None:
    require_field(record, "type", record.type == name, repr(name))


@dataclass
class Selection:
    """What ``select`` keeps: traces in order, their advantages/roles, and atomic units of trace indices."""

    traces: list[Trace] = field(default_factory=list)
    advantages: list[float] = field(default_factory=list)
    roles: list[str] = field(default_factory=list)  # "" | "chosen" | "rejected"
    units: list[list[int]] = field(default_factory=list)  # indices into traces that share a micro-batch
    metrics: dict[str, float] = field(default_factory=dict)
    group_sizes: list[int] = field(default_factory=list)  # samples in the group each trace was picked from

    def add(self, trace: Trace, advantage: float = 0.0, role: str = "", group_size: int = 0) -> int:
        self.traces.append(trace)
        self.advantages.append(advantage)
        self.roles.append(role)
        self.group_sizes.append(group_size)
        return len(self.traces) - 1


@dataclass
class Row:
    """One training window of one selected trace, with its logprobs after the forward."""

    trace_index: int
    advantage: float
    role: str
    loss_mask: Tensor  # [n] bool
    behaviour: Tensor | None  # [n] float32, the sampler's logprobs of the targets; None for SFT data
    logprobs: Tensor | None = None  # [n] float32 recomputed, with grad
    ref_logprobs: Tensor | None = None  # [n] float32 under the frozen reference, no grad
    group_size: int = 0  # samples in the trace's group (BoNBoN's beta follows it)
    target_kind: Tensor | None = None  # [n] int8, planned_diffusion: 0 autoregressive, 1 span body kept, 2 masked
    noise_t: float = 1.0  # planned_diffusion: the trace's noise level t


@dataclass(frozen=True)
class Totals:
    """Counts over the whole step that turn per-micro-batch losses into shares of one loss."""

    num_loss_tokens: int
    num_traces: int  # traces with at least one loss token
    num_units: int  # micro-batch units: BoNBoN pairs, else windows
    trace_loss_tokens: dict[int, int]  # trace index -> its loss tokens over all its windows


def pad(rows: list[Row], attr: str, fill: float = 0.0) -> Tensor:
    """Stack a per-row ``[n_i]`` attribute into ``[B, max n_i]``."""
    values = [getattr(r, attr) for r in rows]
    width = max(v.shape[0] for v in values)
    out = torch.full((len(values), width), fill, dtype=values[0].dtype, device=values[0].device)
    for i, v in enumerate(values):
        out[i, :v.shape[0]] = v
    return out


def _finite(values: list[float]) -> bool:
    return all(isinstance(v, (int, float)) and math.isfinite(v) for v in values)


class Algorithm:
    """Base: every trace of every group trains, one unit each."""

    name: ClassVar[str] = ""
    Options: ClassVar[type]
    uses_pairs: ClassVar[bool] = False  # rows of a unit must see each other's whole loss (one window each)
    needs_sampler_logprobs: ClassVar[bool] = True  # False: traces may carry no sampler logprobs (SFT data)
    trains_spans: ClassVar[bool] = False  # True: takes planned_diffusion traces (their span bodies' diffusion targets)

    @property
    def needs_reference(self) -> bool:
        return False

    def select(self, groups: list[list[Trace]]) -> Selection:
        raise NotImplementedError

    def loss(self, rows: list[Row], totals: Totals) -> LossOutput:
        raise NotImplementedError


class GRPO(Algorithm):
    """Group-relative policy gradient over ``trace.reward`` (``trainer.losses.grpo_loss``).

    Options (``GRPOOptions``): clip_low, clip_high, tis_cap, kl_coef, constant_norm as in
    ``grpo_loss``; aggregation ``token_mean`` (over every loss token of the step),
    ``seq_mean_token_mean`` (each trace's token mean over all its windows, then the mean over
    traces) or ``constant`` (sum over the step / constant_norm); scale_by_std and eps for
    ``group_advantages``; old_logprobs ``sampler`` (the ratio is taken against the sampler's
    logprobs) or ``recomputed`` (against the trainer's own, detached; the sampler's then feed
    ``mismatch_kl`` and the optional TIS weight).
    """

    name = "grpo"
    Options = GRPOOptions

    def __init__(self, options: GRPOOptions = GRPOOptions()):
        self.options = options

    @property
    def needs_reference(self) -> bool:
        return self.options.kl_coef != 0.0

    def select(self, groups: list[list[Trace]]) -> Selection:
        sel = Selection(metrics={"zero_variance_groups": 0.0, "skipped_groups_nonfinite_reward": 0.0})
        for group in groups:
            rewards = [t.reward for t in group]
            if not _finite(rewards):
                sel.metrics["skipped_groups_nonfinite_reward"] += 1
                continue
            adv = group_advantages([rewards], scale_by_std=self.options.scale_by_std, eps=self.options.eps)
            if adv.num_zero_variance_groups:
                sel.metrics["zero_variance_groups"] += 1
                continue
            for trace, a in zip(group, adv.advantages[0].tolist()):
                sel.units.append([sel.add(trace, a)])
        return sel

    def loss(self, rows: list[Row], totals: Totals) -> LossOutput:
        o = self.options
        weight, norm = self._weights(rows, totals)  # [B, T], scalar
        logprobs, behaviour = pad(rows, "logprobs"), pad(rows, "behaviour")
        mask = pad(rows, "loss_mask", False)
        sampler_old = o.old_logprobs == "sampler"
        return grpo_loss(
            logprobs, behaviour if sampler_old else logprobs.detach(),
            torch.tensor([r.advantage for r in rows], device=logprobs.device), mask * weight,
            behaviour_logprobs=None if sampler_old else behaviour, clip_low=o.clip_low,
            clip_high=o.clip_high, tis_cap=o.tis_cap,
            ref_logprobs=pad(rows, "ref_logprobs") if self.needs_reference else None, kl_coef=o.kl_coef,
            aggregation="constant", constant_norm=norm)

    def _weights(self, rows: list[Row], totals: Totals) -> tuple[Tensor, float]:
        """Per-token weights and the normaliser that make the micro-batch sums add up to the step's aggregate."""
        aggregation = self.options.aggregation
        ones = pad(rows, "loss_mask", False).float()
        if aggregation == "token_mean":
            return ones, float(totals.num_loss_tokens)
        if aggregation == "constant":
            return ones, float(self.options.constant_norm)
        per_trace = torch.tensor([1.0 / totals.trace_loss_tokens[r.trace_index] for r in rows], device=ones.device)
        return ones * per_trace[:, None], float(totals.num_traces)


class BoNBoN(Algorithm):
    """Best-vs-worst preference training (Pasta §3.4): ``alpha · SFT(best) + (1 - alpha) · IPO(best, worst)``.

    Each sample's score is ``speedup + quality_weight · quality`` (``latency_aware_score``) read from
    ``trace.reward_components[speedup_key]`` and ``[quality_key]`` (defaults ``"speedup"`` and
    ``"correctness"``, the names ``rewards.SpeedupReward`` and ``MathReward`` give them;
    ``speedup_key=None`` scores by quality alone). A missing key is an error; groups with a
    non-finite score or all-equal scores give no pair and are skipped and counted.
    The IPO margin uses sequence sums over each trace's loss tokens (under truncation, its last W).
    Options (``BoNBoNOptions``): alpha (0.005), beta (None: ``bonbon_beta(n)`` for each pair, n its
    group's number of samples), quality_weight λ (1.0), speedup_key, quality_key. The SFT term is the
    token mean within a micro-batch; micro-batches are weighted by their share of the step's pairs (exact
    when all pairs fit in one micro-batch).
    """

    name = "bonbon"
    Options = BoNBoNOptions
    uses_pairs = True

    def __init__(self, options: BoNBoNOptions = BoNBoNOptions()):
        self.options = options

    @property
    def needs_reference(self) -> bool:
        return True

    def score(self, trace: Trace) -> float:
        o, parts = self.options, trace.reward_components
        keys = [k for k in (o.speedup_key, o.quality_key) if k is not None]
        missing = [k for k in keys if k not in parts]
        if missing:
            raise ValueError(f"trace {trace.trace_id!r} has no reward component(s) {missing} for BoNBoN's score; "
                             f"it has {sorted(parts)} (set bonbon speedup_key/quality_key)")
        speedup = parts[o.speedup_key] if o.speedup_key is not None else 0.0
        return float(latency_aware_score(speedup, parts[o.quality_key], o.quality_weight))

    def select(self, groups: list[list[Trace]]) -> Selection:
        sel = Selection(metrics={"no_pair_groups": 0.0, "skipped_groups_nonfinite_reward": 0.0})
        for group in groups:
            if not _finite([t.reward for t in group]):  # e.g. a reward term failed: its components are missing
                sel.metrics["skipped_groups_nonfinite_reward"] += 1
                continue
            scores = [self.score(t) for t in group]
            if not _finite(scores):
                sel.metrics["skipped_groups_nonfinite_reward"] += 1
                continue
            pairs = preference_pairs([scores])
            if pairs.num_skipped:
                sel.metrics["no_pair_groups"] += 1
                continue
            chosen, rejected = group[pairs.chosen[0]], group[pairs.rejected[0]]
            sel.units.append([sel.add(chosen, role="chosen", group_size=len(group)),
                              sel.add(rejected, role="rejected", group_size=len(group))])
        return sel

    def pair_beta(self, chosen: Row) -> float:
        """IPO's beta of the pair whose best sample is ``chosen``: the option, else ``bonbon_beta(n)``."""
        return self.options.beta if self.options.beta is not None else bonbon_beta(chosen.group_size)

    def loss(self, rows: list[Row], totals: Totals) -> LossOutput:
        chosen = [r for r in rows if r.role == "chosen"]
        rejected = [r for r in rows if r.role == "rejected"]
        ref_sum = lambda rs: (pad(rs, "ref_logprobs") * pad(rs, "loss_mask", False)).sum(dim=1)  # noqa: E731  [P]
        beta = torch.tensor([self.pair_beta(r) for r in chosen], device=chosen[0].logprobs.device)  # [P]
        out = bonbon_loss(pad(chosen, "logprobs"), pad(chosen, "loss_mask", False), pad(rejected, "logprobs"),
                          pad(rejected, "loss_mask", False), ref_sum(chosen), ref_sum(rejected),
                          alpha=self.options.alpha, beta=beta)
        share = len(chosen) / totals.num_units
        return LossOutput(out.loss * share, {**out.metrics, "loss": out.metrics["loss"] * share})


class SFT(Algorithm):
    """Supervised training: every trace is a target; masked token-mean NLL over the whole step.

    The only algorithm that takes traces without sampler logprobs (``Trace.logprobs == []``, SFT data).
    """

    name = "sft"
    Options = SFTOptions
    needs_sampler_logprobs = False

    def __init__(self, options: SFTOptions = SFTOptions()):
        self.options = options

    def select(self, groups: list[list[Trace]]) -> Selection:
        sel = Selection()
        for group in groups:
            for trace in group:
                sel.units.append([sel.add(trace)])
        return sel

    def loss(self, rows: list[Row], totals: Totals) -> LossOutput:
        mask = pad(rows, "loss_mask", False)
        out = sft_loss(pad(rows, "logprobs"), mask)
        share = int(mask.sum()) / totals.num_loss_tokens
        return LossOutput(out.loss * share, {**out.metrics, "loss": out.metrics["loss"] * share})


class PlannedDiffusion(Algorithm):
    """Planned Diffusion's one model, two objectives (``trainer.losses.planned_diffusion_loss``): the
    autoregressive cross-entropy on plan and ordinary tokens plus the masked-diffusion loss on span body tokens
    (each trace's noise drawn by the learner, ``core.planned_diffusion.SpanNoise``), normalised by the step's
    autoregressive and span tokens. A trace without spans (any other policy) trains as SFT would.

    Options (``PlannedDiffusionOptions``): select ``all`` (SFT data) or ``correct`` (rollouts whose
    ``quality_key`` component reaches 1; groups without one are skipped and counted).
    """

    name = "planned_diffusion"
    Options = PlannedDiffusionOptions
    needs_sampler_logprobs = False
    trains_spans = True

    def __init__(self, options: PlannedDiffusionOptions = PlannedDiffusionOptions()):
        self.options = options

    def select(self, groups: list[list[Trace]]) -> Selection:
        sel = Selection(metrics={"no_correct_groups": 0.0} if self.options.select == "correct" else {})
        for group in groups:
            kept = [t for t in group if self._keeps(t)]
            if not kept:
                sel.metrics["no_correct_groups"] += 1
            for trace in kept:
                sel.units.append([sel.add(trace)])
        return sel

    def _keeps(self, trace: Trace) -> bool:
        if self.options.select == "all":
            return True
        key = self.options.quality_key
        if key not in trace.reward_components:
            raise ValueError(f"trace {trace.trace_id!r} has no reward component {key!r} for planned_diffusion's "
                             f"select=correct; it has {sorted(trace.reward_components)}")
        return trace.reward_components[key] >= 1.0

    def loss(self, rows: list[Row], totals: Totals) -> LossOutput:
        mask = pad(rows, "loss_mask", False)
        kind = torch.stack([torch.nn.functional.pad(r.target_kind if r.target_kind is not None else
                                                    torch.zeros(r.loss_mask.shape, dtype=torch.int8),
                                                    (0, mask.shape[1] - r.loss_mask.shape[0]))
                            for r in rows]).to(mask.device)
        t = torch.tensor([r.noise_t for r in rows], device=mask.device)
        out = planned_diffusion_loss(pad(rows, "logprobs"), mask & (kind == 0), mask & (kind > 0),
                                     mask & (kind == 2), t, num_tokens=totals.num_loss_tokens)
        return out


ALGORITHMS: dict[str, type[Algorithm]] = {cls.name: cls for cls in (GRPO, BoNBoN, SFT, PlannedDiffusion)}


def make_algorithm(options: AlgorithmOptions) -> Algorithm:
    """The registered algorithm for ``options`` (its ``type``), built from the record."""
    if options.type not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {options.type!r}; valid: {', '.join(ALGORITHMS)}")
    return ALGORITHMS[options.type](options)


def options_from_dict(data: dict[str, Any]) -> AlgorithmOptions:
    """The options record of ``data["type"]`` from plain values; unknown keys are an error naming the valid ones."""
    data = dict(data)
    name = data.get("type", "grpo")
    if name not in ALGORITHMS:
        raise ValueError(f"type must be one of {', '.join(ALGORITHMS)}, got {name!r}")
    record = ALGORITHMS[name].Options
    valid = {f.name for f in fields(record)}
    unknown = sorted(set(data) - valid)
    if unknown:
        raise ValueError(f"unknown {name} option(s) {unknown}; valid: {sorted(valid - {'type'})}")
    return record(**data)
