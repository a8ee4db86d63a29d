"""Pure learner losses: ``loss(inputs) -> LossOutput(loss, metrics)``.

Every loss takes padded batches and an already-computed ``loss_mask`` (bool or float >= 0; a token
contributes where the mask is > 0, weighted by the mask value). Nothing here knows about models,
KV policies or Ray. Shape letters: B sequences, T padded token positions, G groups of n samples,
P preference pairs.

Masked positions never reach the arithmetic: inputs are replaced by 0 there before any exp/log,
so padding may hold anything (even -inf) and the gradient outside the mask is exactly 0.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "constant")


@dataclass(frozen=True)
class LossOutput:
    """A scalar loss to backpropagate and python-float metrics to log."""

    loss: torch.Tensor  # [] float32
    metrics: dict[str, float]


@dataclass(frozen=True)
class GroupAdvantages:
    """Per-sample advantages (same shape as the rewards) and how many groups carried no signal."""

    advantages: torch.Tensor
    num_zero_variance_groups: int
    num_groups: int


@dataclass(frozen=True)
class PreferencePairs:
    """Best/worst sample index (within its group) for every group whose scores are not all equal."""

    groups: list[int]
    chosen: list[int]
    rejected: list[int]
    num_skipped: int


# --------------------------------------------------------------------------- advantages


def group_advantages(
    rewards: torch.Tensor | Sequence,
    group_ids: torch.Tensor | Sequence[int] | None = None,
    *,
    scale_by_std: bool = False,
    eps: float = 1e-6,
) -> GroupAdvantages:
    """GRPO advantages: ``r - mean(group)``, optionally divided by ``std(group) + eps``.

    rewards: ``[G, n]`` (one row per group, ``group_ids`` None) or flat ``[B]`` with ``group_ids [B]``.
    The std is the population std (divide by the group size), so a group of one has std 0. The
    default (no scaling) is Dr.GRPO's. A group whose rewards are all equal gets advantage exactly 0
    and is counted in ``num_zero_variance_groups``. NaN or inf rewards raise ValueError naming the
    sample and its group. Computed in float64; returned as float32.
    """
    r = torch.as_tensor(rewards)
    if r.numel() == 0:
        raise ValueError(f"rewards are empty (shape {tuple(r.shape)}); advantages need at least one sample")
    if r.dim() == 2 and group_ids is None:
        num_groups, n = r.shape
        ids = torch.arange(num_groups, device=r.device).repeat_interleave(n)
        _check_finite_grid(r)
        adv, zero = _centre_groups(r.reshape(-1).double(), ids, scale_by_std, eps)
        return GroupAdvantages(adv.reshape(num_groups, n).float(), zero, num_groups)
    if r.dim() == 1 and group_ids is not None:
        ids = torch.as_tensor(group_ids, device=r.device)
        if ids.shape != r.shape:
            raise ValueError(f"group_ids shape {tuple(ids.shape)} must match rewards shape {tuple(r.shape)}")
        _check_finite_flat(r, ids)
        _, inverse = torch.unique(ids, return_inverse=True)
        adv, zero = _centre_groups(r.double(), inverse, scale_by_std, eps)
        return GroupAdvantages(adv.float(), zero, int(inverse.max()) + 1)
    raise ValueError(
        f"rewards must be [G, n] without group_ids or flat [B] with group_ids; "
        f"got shape {tuple(r.shape)} and group_ids={'given' if group_ids is not None else 'None'}"
    )


def _check_finite_grid(r: torch.Tensor) -> None:
    bad = (~torch.isfinite(r)).nonzero()
    if len(bad):
        g, i = bad[0].tolist()
        raise ValueError(f"reward {r[g, i].item()} is not finite (group {g}, sample {i}); rewards must be finite")


def _check_finite_flat(r: torch.Tensor, ids: torch.Tensor) -> None:
    bad = (~torch.isfinite(r)).nonzero()
    if len(bad):
        b = bad[0].item()
        where = f"sample {b}, group id {ids[b].item()}"
        raise ValueError(f"reward {r[b].item()} is not finite ({where}); rewards must be finite")


def _centre_groups(r: torch.Tensor, inverse: torch.Tensor, scale_by_std: bool, eps: float) -> tuple[torch.Tensor, int]:
    """r: [B] float64, inverse: [B] group index in 0..G-1 -> (advantages [B], zero-variance groups)."""
    num_groups = int(inverse.max()) + 1
    counts = torch.bincount(inverse, minlength=num_groups).double()  # [G]

    def per_group(init: float, values: torch.Tensor, reduce: str) -> torch.Tensor:  # [B] -> [G]
        out = torch.full((num_groups,), init, dtype=r.dtype, device=r.device)
        return out.scatter_reduce(0, inverse, values, reduce)

    mean = per_group(0.0, r, "sum") / counts
    constant = per_group(-math.inf, r, "amax") == per_group(math.inf, r, "amin")  # [G]
    adv = torch.where(constant[inverse], torch.zeros_like(r), r - mean[inverse])
    if scale_by_std:
        std = (per_group(0.0, adv**2, "sum") / counts).sqrt()  # [G] population std
        adv = torch.where(constant[inverse], adv, adv / (std[inverse] + eps))
    return adv, int(constant.sum())


# --------------------------------------------------------------------------- GRPO


def grpo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    behaviour_logprobs: torch.Tensor | None = None,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    tis_cap: float | None = None,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    aggregation: str = "token_mean",
    constant_norm: float | None = None,
) -> LossOutput:
    """Clipped policy-gradient loss with DAPO clip-higher, optional TIS and k3 KL.

    Tensors (all ``[B, T]`` unless noted; log-probabilities of the sampled tokens):
        logprobs: current policy, with grad.
        old_logprobs: the policy that produced the trace, as the trainer computes it (no grad used).
            Without recomputation pass the sampler's logprobs here and leave ``behaviour_logprobs`` None.
        advantages: ``[B]``, one per sequence.
        loss_mask: bool or float >= 0.
        behaviour_logprobs: the sampler's own logprobs when they came from a different engine than
            ``old_logprobs``. With ``tis_cap`` the per-token loss is multiplied by the truncated
            importance weight ``min(exp(old - behaviour), tis_cap)`` (no grad). Whenever given, the
            sampler/trainer mismatch ``mismatch_kl`` (k3 estimate of KL(behaviour || old)) is logged.
        ref_logprobs: reference policy; adds ``kl_coef * k3`` with ``k3 = exp(ref - lp) - (ref - lp) - 1``.

    Per token: ``-min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A)``, ``ratio = exp(lp - old)``.
    aggregation: ``token_mean`` (masked sum / mask sum), ``seq_mean_token_mean`` (mean over sequences
    that have loss tokens of each one's masked mean) or ``constant`` (masked sum / ``constant_norm``, Dr.GRPO).
    Metrics: loss, clip_frac_low, clip_frac_high, ratio_mean, num_loss_tokens, and kl / mismatch_kl /
    tis_weight_mean / tis_capped_frac when those inputs are given. Token fractions and means are
    unweighted over the tokens where the mask is > 0.
    """
    _check_grpo_args(clip_low, clip_high, tis_cap, kl_coef, ref_logprobs, behaviour_logprobs, aggregation,
                     constant_norm)
    mask = _mask(loss_mask, logprobs.shape)
    on = mask > 0
    n_tokens = _num_loss_tokens(on)
    _check_same_shape(
        logprobs.shape, old_logprobs=old_logprobs, behaviour_logprobs=behaviour_logprobs, ref_logprobs=ref_logprobs
    )
    if advantages.shape != logprobs.shape[:1]:
        raise ValueError(f"advantages must be [B] = {tuple(logprobs.shape[:1])}, got {tuple(advantages.shape)}")

    lp = _masked(logprobs, on)  # [B, T] grad flows only where on
    old = _masked(old_logprobs, on).detach()
    adv = advantages.detach().float()[:, None]  # [B, 1]
    ratio = torch.exp(lp - old)  # [B, T]
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    per_token = -torch.minimum(ratio * adv, clipped * adv)  # [B, T]

    metrics = {
        "clip_frac_low": _frac(on & (adv < 0) & (ratio < 1.0 - clip_low), n_tokens),
        "clip_frac_high": _frac(on & (adv > 0) & (ratio > 1.0 + clip_high), n_tokens),
        "ratio_mean": _mean_on(ratio.detach(), on, n_tokens),
        "num_loss_tokens": float(n_tokens),
    }
    if behaviour_logprobs is not None:
        log_w = old - _masked(behaviour_logprobs, on).detach()  # log(pi_old / pi_behaviour)
        metrics["mismatch_kl"] = _mean_on(_k3(log_w), on, n_tokens)
        if tis_cap is not None:
            weight = torch.exp(log_w).clamp(max=tis_cap)
            per_token = per_token * weight
            metrics["tis_weight_mean"] = _mean_on(weight, on, n_tokens)
            metrics["tis_capped_frac"] = _frac(on & (log_w > math.log(tis_cap)), n_tokens)
    if ref_logprobs is not None:
        kl = _k3(_masked(ref_logprobs, on).detach() - lp)  # [B, T]
        per_token = per_token + kl_coef * kl
        metrics["kl"] = _mean_on(kl.detach(), on, n_tokens)

    loss = _aggregate(per_token, mask, aggregation, constant_norm)
    metrics["loss"] = loss.item()
    return LossOutput(loss, metrics)


def _check_grpo_args(clip_low, clip_high, tis_cap, kl_coef, ref, behaviour, aggregation, constant_norm) -> None:
    if not 0.0 <= clip_low < 1.0:
        raise ValueError(f"clip_low must be in [0, 1), got {clip_low}")
    if clip_high < 0.0:
        raise ValueError(f"clip_high must be >= 0, got {clip_high}")
    if tis_cap is not None and not tis_cap > 0:
        raise ValueError(f"tis_cap must be > 0 or None, got {tis_cap}")
    if tis_cap is not None and behaviour is None:
        raise ValueError("tis_cap is set but behaviour_logprobs is None; pass the sampler's logprobs to use TIS")
    if kl_coef != 0.0 and ref is None:
        raise ValueError(f"kl_coef={kl_coef} needs ref_logprobs; pass them or set kl_coef=0")
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {aggregation!r}; valid: {', '.join(AGGREGATIONS)}")
    if aggregation == "constant" and (constant_norm is None or not constant_norm > 0):
        raise ValueError(f"aggregation='constant' needs constant_norm > 0, got {constant_norm}")


def _k3(log_ratio: torch.Tensor) -> torch.Tensor:
    """k3 KL estimator ``exp(x) - x - 1`` of the log ratio x = log(p_other / p_sampled); >= 0."""
    return torch.exp(log_ratio) - log_ratio - 1.0


def _aggregate(per_token: torch.Tensor, mask: torch.Tensor, aggregation: str, constant_norm: float | None):
    """per_token, mask: [B, T] -> scalar."""
    weighted = per_token * mask  # [B, T]
    if aggregation == "token_mean":
        return weighted.sum() / mask.sum()
    if aggregation == "constant":
        return weighted.sum() / constant_norm
    seq_weight = mask.sum(dim=1)  # [B]
    has_tokens = seq_weight > 0
    return (weighted.sum(dim=1)[has_tokens] / seq_weight[has_tokens]).mean()


# --------------------------------------------------------------------------- SFT, IPO, BoNBoN


def sft_loss(logprobs: torch.Tensor, loss_mask: torch.Tensor) -> LossOutput:
    """Masked token-mean negative log-likelihood. logprobs, loss_mask: ``[B, T]``.

    Metrics: loss (= nll), num_loss_tokens.
    """
    mask = _mask(loss_mask, logprobs.shape)
    on = mask > 0
    n_tokens = _num_loss_tokens(on)
    loss = -(_masked(logprobs, on) * mask).sum() / mask.sum()
    return LossOutput(loss, {"loss": loss.item(), "num_loss_tokens": float(n_tokens)})


def ipo_loss(
    pi_chosen: torch.Tensor,
    ref_chosen: torch.Tensor,
    pi_rejected: torch.Tensor,
    ref_rejected: torch.Tensor,
    beta: float | torch.Tensor,
) -> LossOutput:
    """IPO on sequence-summed logprobs, all ``[P]``: ``mean((h - 1/(2 beta))^2)``.

    ``h = (pi_chosen - ref_chosen) - (pi_rejected - ref_rejected)``; the reference terms carry no grad.
    beta: one value, or ``[P]`` (one per pair: BoNBoN's follows each pair's group size).
    Metrics: loss, margin_mean (mean h), margin_target (mean 1/(2 beta)), pair_accuracy (fraction h > 0).
    """
    beta = torch.as_tensor(beta, dtype=torch.float32, device=pi_chosen.device)
    if not bool((beta > 0).all()) or beta.dim() > 1:
        raise ValueError(f"IPO beta must be > 0 (one value or one per pair), got {beta.tolist()}")
    _check_same_shape(pi_chosen.shape, ref_chosen=ref_chosen, pi_rejected=pi_rejected, ref_rejected=ref_rejected)
    if pi_chosen.dim() != 1 or pi_chosen.numel() == 0:
        raise ValueError(f"IPO inputs must be non-empty [P] sequence logprobs, got shape {tuple(pi_chosen.shape)}")
    if beta.dim() == 1 and beta.shape != pi_chosen.shape:
        raise ValueError(f"IPO beta has {beta.numel()} values for {pi_chosen.numel()} pairs")
    h = (pi_chosen.float() - ref_chosen.detach().float()) - (pi_rejected.float() - ref_rejected.detach().float())  # [P]
    target = 1.0 / (2.0 * beta)  # [] or [P]
    loss = ((h - target) ** 2).mean()
    metrics = {
        "loss": loss.item(),
        "margin_mean": h.detach().mean().item(),
        "margin_target": target.mean().item(),
        "pair_accuracy": (h.detach() > 0).float().mean().item(),
    }
    return LossOutput(loss, metrics)


def bonbon_beta(num_samples: int) -> float:
    """BoNBoN's IPO beta for best-vs-worst of n samples: ``1 / (2 (n-1) H_{n-1})``, H the harmonic number.

    Under the best-of-n policy the expected log-ratio margin between the best and the worst of n
    samples is ``(n-1) H_{n-1}``; IPO's target margin ``1/(2 beta)`` is set to it.
    """
    if num_samples < 2:
        raise ValueError(f"best-vs-worst pairs need num_samples >= 2, got {num_samples}")
    harmonic = sum(1.0 / k for k in range(1, num_samples))
    return 1.0 / (2.0 * (num_samples - 1) * harmonic)


def bonbon_loss(
    chosen_logprobs: torch.Tensor,
    chosen_mask: torch.Tensor,
    rejected_logprobs: torch.Tensor,
    rejected_mask: torch.Tensor,
    ref_chosen_seq: torch.Tensor,
    ref_rejected_seq: torch.Tensor,
    *,
    alpha: float = 0.005,
    beta: float | torch.Tensor,
) -> LossOutput:
    """BoNBoN: ``alpha * SFT(chosen) + (1 - alpha) * IPO(chosen, rejected)``.

    chosen_logprobs, chosen_mask, rejected_logprobs, rejected_mask: ``[P, T]`` per-token logprobs of
    the best / worst sample of each group under the current policy and their loss masks.
    ref_chosen_seq, ref_rejected_seq: ``[P]`` reference logprobs summed over the same masks.
    SFT is the masked token-mean NLL of the chosen samples (``sft_loss``). alpha = 0.005 is Pasta's
    (from BoNBoN). beta: IPO's, one value or ``[P]``; BoNBoN's is ``bonbon_beta(n)`` for pairs taken from
    n samples (``trainer.algorithms.BoNBoN`` gives each pair its group's).
    Metrics: loss, sft/*, ipo/*.
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"BoNBoN alpha must be in [0, 1], got {alpha}")
    pi_chosen = _sequence_sum(chosen_logprobs, chosen_mask)  # [P]
    pi_rejected = _sequence_sum(rejected_logprobs, rejected_mask)  # [P]
    sft = sft_loss(chosen_logprobs, chosen_mask)
    ipo = ipo_loss(pi_chosen, ref_chosen_seq, pi_rejected, ref_rejected_seq, beta)
    loss = alpha * sft.loss + (1.0 - alpha) * ipo.loss
    metrics = {"loss": loss.item()}
    metrics.update({f"{name}/{k}": v for name, part in (("sft", sft), ("ipo", ipo)) for k, v in part.metrics.items()})
    return LossOutput(loss, metrics)


def planned_diffusion_loss(logprobs: torch.Tensor, ar_mask: torch.Tensor, span_mask: torch.Tensor,
                           masked: torch.Tensor, t: torch.Tensor, *, num_tokens: float | None = None) -> LossOutput:
    """Planned Diffusion's hybrid objective: autoregressive cross-entropy plus the masked-diffusion loss.

    ``-(sum of ar_mask · logprobs + sum of masked · logprobs / t) / N``, ``N = num_tokens`` (the step's
    autoregressive and span body tokens, when a micro-batch is one share of a step) or the mask's
    ``sum(ar_mask | span_mask)``. The diffusion term is the ELBO of the absorbing-state process: t ~ U(0, 1) per
    sequence, each span body token masked with probability t, the masked ones predicted (their logprobs are of
    the clean token at the masked position) and weighted 1/t; a body token left unmasked is counted in N and
    costs nothing.

    logprobs, ar_mask, span_mask, masked: ``[B, T]`` (masks bool; ``masked`` within ``span_mask``, disjoint from
    ``ar_mask``); t: ``[B]`` in (0, 1], each sequence's noise level.
    Metrics: loss, ar_nll (mean over autoregressive tokens), diffusion_nll (mean over masked tokens, unweighted),
    mask_rate (masked / span tokens), num_loss_tokens.
    """
    _check_same_shape(logprobs.shape, ar_mask=ar_mask, span_mask=span_mask, masked=masked)
    ar, span, hit = ar_mask.bool(), span_mask.bool(), masked.bool()
    if (hit & ~span).any() or (ar & span).any():
        raise ValueError("masked tokens must be span tokens, and span tokens are no autoregressive targets")
    if t.shape != logprobs.shape[:1] or not bool(((t > 0) & (t <= 1)).all()):
        raise ValueError(f"t must be [B] = {tuple(logprobs.shape[:1])} noise levels in (0, 1], got {t.tolist()}")
    n_tokens = _num_loss_tokens(ar | span)
    norm = float(n_tokens if num_tokens is None else num_tokens)
    ar_sum = _masked(logprobs, ar).sum()
    diffusion = (_masked(logprobs, hit) / t.float()[:, None]).sum()
    loss = -(ar_sum + diffusion) / norm
    n_ar, n_hit = int(ar.sum()), int(hit.sum())
    metrics = {"loss": loss.item(), "num_loss_tokens": float(n_tokens),
               "ar_nll": -ar_sum.item() / n_ar if n_ar else 0.0,
               "diffusion_nll": -_masked(logprobs, hit).sum().item() / n_hit if n_hit else 0.0,
               "mask_rate": n_hit / max(int(span.sum()), 1)}
    return LossOutput(loss, metrics)


def _sequence_sum(logprobs: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """[P, T] -> [P] masked sum."""
    mask = _mask(loss_mask, logprobs.shape)
    return (_masked(logprobs, mask > 0) * mask).sum(dim=1)


# --------------------------------------------------------------------------- preference pairs


def latency_aware_score(speedup, quality, quality_weight: float):
    """Pasta's ranking score ``speedup + lambda * quality``; ``lambda = inf`` ranks by quality alone."""
    if math.isinf(quality_weight) and quality_weight > 0:
        return quality
    return speedup + quality_weight * quality


def preference_pairs(scores: torch.Tensor | Sequence[Sequence[float]]) -> PreferencePairs:
    """Best -> chosen, worst -> rejected, per group of scores (``[G, N]`` or a ragged list of lists).

    Ties resolve to the first sample with the extreme score. Groups whose scores are all equal give
    no preference and are skipped and counted. NaN scores raise ValueError naming the group.
    """
    rows = scores.tolist() if isinstance(scores, torch.Tensor) else [list(row) for row in scores]
    groups, chosen, rejected = [], [], []
    for g, row in enumerate(rows):
        if any(math.isnan(s) for s in row):
            raise ValueError(f"group {g} has a NaN score {row}; scores must be numbers")
        if len(row) >= 2 and max(row) != min(row):
            groups.append(g)
            chosen.append(row.index(max(row)))
            rejected.append(row.index(min(row)))
    return PreferencePairs(groups, chosen, rejected, num_skipped=len(rows) - len(groups))


# --------------------------------------------------------------------------- helpers


def _mask(loss_mask: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """bool/float [B, T] -> float32 [B, T], checked."""
    if loss_mask.shape != shape:
        raise ValueError(f"loss_mask shape {tuple(loss_mask.shape)} must match logprobs shape {tuple(shape)}")
    mask = loss_mask.detach().float()
    if not torch.isfinite(mask).all() or (mask < 0).any():
        raise ValueError("loss_mask must be finite and >= 0 (bool, or float weights)")
    return mask


def _num_loss_tokens(on: torch.Tensor) -> int:
    n = int(on.sum())
    if n == 0:
        raise ValueError(f"loss_mask selects no tokens (shape {tuple(on.shape)}); a loss needs at least one token")
    return n


def _masked(x: torch.Tensor, on: torch.Tensor) -> torch.Tensor:
    """x as float32 where on, exactly 0 elsewhere (so padding never produces NaN or gradient)."""
    return torch.where(on, x.float(), torch.zeros((), dtype=torch.float32, device=x.device))


def _check_same_shape(shape: torch.Size, **tensors: torch.Tensor | None) -> None:
    for name, t in tensors.items():
        if t is not None and t.shape != shape:
            raise ValueError(f"{name} shape {tuple(t.shape)} must be {tuple(shape)}")


def _frac(selected: torch.Tensor, n_tokens: int) -> float:
    return int(selected.sum()) / n_tokens


def _mean_on(x: torch.Tensor, on: torch.Tensor, n_tokens: int) -> float:
    return (x * on).sum().item() / n_tokens


LOSSES = {"grpo": grpo_loss, "bonbon": bonbon_loss, "sft": sft_loss, "planned_diffusion": planned_diffusion_loss}
