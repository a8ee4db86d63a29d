"""Learner losses against values worked out by hand (the arithmetic is in the comments)."""

import math

import pytest
import torch

from sliderl.trainer.losses import (
    LOSSES,
    bonbon_beta,
    bonbon_loss,
    group_advantages,
    grpo_loss,
    ipo_loss,
    latency_aware_score,
    planned_diffusion_loss,
    preference_pairs,
    sft_loss,
)

LN2 = math.log(2.0)


def close(actual, expected, tol=1e-5):
    actual, expected = (torch.as_tensor(x, dtype=torch.float64) for x in (actual, expected))
    return torch.allclose(actual, expected, atol=tol, rtol=0)


# --------------------------------------------------------------------------- advantages

REWARDS = [[1.0, 0.0, 0.0, 0.0], [2.0, 2.0, 2.0, 2.0], [3.0, 1.0, 2.0, 2.0]]


def test_group_advantages_subtract_the_group_mean_and_count_constant_groups():
    out = group_advantages(torch.tensor(REWARDS))
    # g0 mean 0.25 -> [0.75, -0.25, -0.25, -0.25]; g1 all equal -> 0; g2 mean 2 -> [1, -1, 0, 0]
    assert close(out.advantages, [[0.75, -0.25, -0.25, -0.25], [0, 0, 0, 0], [1, -1, 0, 0]])
    assert out.num_zero_variance_groups == 1
    assert out.num_groups == 3


def test_group_advantages_scaled_by_population_std():
    out = group_advantages(REWARDS, scale_by_std=True, eps=0.0)
    # g0: var = (0.75^2 + 3 * 0.25^2) / 4 = 0.75 / 4 = 0.1875, std = sqrt(3)/4
    #     0.75 / (sqrt(3)/4) = sqrt(3); -0.25 / (sqrt(3)/4) = -1/sqrt(3)
    # g1: constant -> stays 0 (no 0/0 even with eps = 0)
    # g2: var = (1 + 1 + 0 + 0) / 4 = 0.5, std = 1/sqrt(2) -> [sqrt(2), -sqrt(2), 0, 0]
    s3, s2 = math.sqrt(3.0), math.sqrt(2.0)
    assert close(out.advantages, [[s3, -1 / s3, -1 / s3, -1 / s3], [0, 0, 0, 0], [s2, -s2, 0, 0]])
    assert out.num_zero_variance_groups == 1


def test_group_advantages_flat_with_group_ids():
    # group 7: rewards [1, 3] mean 2 -> [-1, 1]; group 3: rewards [5, 0] mean 2.5 -> [2.5, -2.5]
    out = group_advantages(torch.tensor([1.0, 5.0, 3.0, 0.0]), group_ids=[7, 3, 7, 3])
    assert close(out.advantages, [-1.0, 2.5, 1.0, -2.5])
    assert out.num_zero_variance_groups == 0 and out.num_groups == 2


def test_group_advantages_reject_nan_and_inf_naming_the_sample():
    with pytest.raises(ValueError, match=r"group 1, sample 2"):
        group_advantages(torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, math.nan]]))
    with pytest.raises(ValueError, match=r"sample 2, group id 9"):
        group_advantages(torch.tensor([0.0, 1.0, math.inf]), group_ids=[4, 4, 9])
    with pytest.raises(ValueError, match="group_ids"):
        group_advantages(torch.tensor([0.0, 1.0]))


# --------------------------------------------------------------------------- GRPO
# Two sequences with old = 0 and lp = log(ratio). clip range [1 - 0.2, 1 + 0.28] = [0.8, 1.28].
# row 0, A = +1, ratios [1.5, 0.5, 1.1]: min(r, clip r) = [1.28 (high clip), 0.5, 1.1] -> loss [-1.28, -0.5, -1.1]
# row 1, A = -1, ratios [1.5, 0.5, 0.9]: min(-r, -clip r) = [-1.5, -0.8 (low clip), -0.9] -> loss [1.5, 0.8, 0.9]
RATIOS = [[1.5, 0.5, 1.1], [1.5, 0.5, 0.9]]
ADV = torch.tensor([1.0, -1.0])


def _grpo_inputs():
    lp = torch.tensor(RATIOS).log().requires_grad_()
    return lp, torch.zeros(2, 3)


def test_grpo_clips_high_for_positive_and_low_for_negative_advantages():
    lp, old = _grpo_inputs()
    out = grpo_loss(lp, old, ADV, torch.ones(2, 3))
    # token mean: (-1.28 - 0.5 - 1.1 + 1.5 + 0.8 + 0.9) / 6 = 0.32 / 6
    assert close(out.loss.item(), 0.32 / 6)
    assert out.metrics["clip_frac_high"] == pytest.approx(1 / 6)
    assert out.metrics["clip_frac_low"] == pytest.approx(1 / 6)
    assert out.metrics["ratio_mean"] == pytest.approx(6.0 / 6)  # 1.5+.5+1.1+1.5+.5+.9 = 6
    assert out.metrics["num_loss_tokens"] == 6.0
    assert all(isinstance(v, float) for v in out.metrics.values())
    out.loss.backward()
    # d(-A r)/d lp = -A r where unclipped, 0 where the clipped branch is taken; / 6 tokens
    assert close(lp.grad, [[0.0, -0.5 / 6, -1.1 / 6], [1.5 / 6, 0.0, 0.9 / 6]])


def test_grpo_inside_the_clip_range_the_ratio_is_not_clipped_on_the_other_side():
    # A > 0 with ratio 0.5 < 0.8 and A < 0 with ratio 1.5 > 1.28 keep the unclipped term (pessimistic min)
    lp, old = _grpo_inputs()
    out = grpo_loss(lp, old, ADV, torch.tensor([[0, 1, 0], [1, 0, 0]], dtype=torch.bool))
    # tokens: row 0 pos 1 -> -0.5, row 1 pos 0 -> 1.5; mean = 0.5
    assert close(out.loss.item(), 0.5)
    assert out.metrics["clip_frac_low"] == 0.0 and out.metrics["clip_frac_high"] == 0.0


MASK = torch.tensor([[1.0, 1.0, 1.0], [0.0, 1.0, 0.0], [0.0, 0.0, 0.0]])


def _masked_grpo_inputs():
    """The two rows above plus a fully masked third row; garbage (NaN, -inf) where the mask is 0."""
    lp = torch.tensor(RATIOS + [[0.0, 0.0, 0.0]]).log()
    lp[1, 0] = math.nan
    lp[2, 1] = -math.inf
    old = torch.zeros(3, 3)
    old[1, 2] = -math.inf
    return lp.requires_grad_(), old, torch.tensor([1.0, -1.0, 5.0])


@pytest.mark.parametrize(
    "aggregation, norm, expected",
    [
        # masked tokens: row 0 [-1.28, -0.5, -1.1] (sum -2.88), row 1 [0.8]; row 2 has none
        ("token_mean", None, (-2.88 + 0.8) / 4),  # -0.52
        ("seq_mean_token_mean", None, (-2.88 / 3 + 0.8 / 1) / 2),  # (-0.96 + 0.8) / 2 = -0.08
        ("constant", 8.0, (-2.88 + 0.8) / 8),  # -0.26
    ],
)
def test_grpo_aggregations_and_gradient_only_on_masked_tokens(aggregation, norm, expected):
    lp, old, adv = _masked_grpo_inputs()
    out = grpo_loss(lp, old, adv, MASK, aggregation=aggregation, constant_norm=norm)
    assert close(out.loss.item(), expected)
    assert out.metrics["num_loss_tokens"] == 4.0
    out.loss.backward()
    assert torch.isfinite(lp.grad).all()
    assert (lp.grad[MASK == 0] == 0).all()  # exactly zero, not merely small
    assert (lp.grad[0, 1:] != 0).all()  # unclipped masked tokens do get gradient


def test_grpo_truncated_importance_sampling():
    # ratio 1 (lp = old = 0), A = +1; behaviour = [-ln2, ln2, 0] so exp(old - behaviour) = [2, 0.5, 1]
    # cap 1.5 -> weights [1.5, 0.5, 1]; loss = -(1.5 + 0.5 + 1) / 3 = -1
    lp = torch.zeros(1, 3, requires_grad=True)
    behaviour = torch.tensor([[-LN2, LN2, 0.0]])
    adv, mask = torch.tensor([1.0]), torch.ones(1, 3)
    out = grpo_loss(lp, torch.zeros(1, 3), adv, mask, behaviour_logprobs=behaviour, tis_cap=1.5)
    assert close(out.loss.item(), -1.0)
    assert out.metrics["tis_weight_mean"] == pytest.approx(1.0)
    assert out.metrics["tis_capped_frac"] == pytest.approx(1 / 3)
    # k3 of x = old - behaviour = [ln2, -ln2, 0]: (2 - ln2 - 1) + (0.5 + ln2 - 1) + 0 = 0.5, mean 0.5 / 3
    assert out.metrics["mismatch_kl"] == pytest.approx(0.5 / 3, abs=1e-6)
    out.loss.backward()
    assert close(lp.grad, [[-1.5 / 3, -0.5 / 3, -1.0 / 3]])  # d(-w r)/d lp = -w r = -w


def test_grpo_k3_kl_to_reference():
    # A = 0 -> policy term 0. lp = 0, ref = [ln2, -ln2]: k3 = exp(ref - lp) - (ref - lp) - 1
    # = [2 - ln2 - 1, 0.5 + ln2 - 1] (sum 0.5, mean 0.25); loss = 0.1 * 0.25
    lp = torch.zeros(1, 2, requires_grad=True)
    ref = torch.tensor([[LN2, -LN2]])
    out = grpo_loss(lp, torch.zeros(1, 2), torch.tensor([0.0]), torch.ones(1, 2), ref_logprobs=ref, kl_coef=0.1)
    assert close(out.loss.item(), 0.025)
    assert out.metrics["kl"] == pytest.approx(0.25, abs=1e-6)
    out.loss.backward()
    # d k3 / d lp = 1 - exp(ref - lp) = [1 - 2, 1 - 0.5] = [-1, 0.5], times 0.1 / 2 tokens
    assert close(lp.grad, [[-0.05, 0.025]])


def test_grpo_rejects_an_empty_mask_and_inconsistent_options():
    lp, old = _grpo_inputs()
    with pytest.raises(ValueError, match="no tokens"):
        grpo_loss(lp, old, ADV, torch.zeros(2, 3))
    with pytest.raises(ValueError, match="ref_logprobs"):
        grpo_loss(lp, old, ADV, torch.ones(2, 3), kl_coef=0.1)
    with pytest.raises(ValueError, match="behaviour_logprobs"):
        grpo_loss(lp, old, ADV, torch.ones(2, 3), tis_cap=2.0)
    with pytest.raises(ValueError, match="constant_norm"):
        grpo_loss(lp, old, ADV, torch.ones(2, 3), aggregation="constant")
    with pytest.raises(ValueError, match="token_mean"):
        grpo_loss(lp, old, ADV, torch.ones(2, 3), aggregation="sum")
    with pytest.raises(ValueError, match="advantages"):
        grpo_loss(lp, old, torch.ones(3), torch.ones(2, 3))


# --------------------------------------------------------------------------- SFT, IPO, BoNBoN


def test_sft_is_the_masked_token_mean_nll():
    lp = torch.tensor([[-1.0, -2.0, math.nan], [-3.0, 0.0, -math.inf]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    out = sft_loss(lp, mask)
    assert close(out.loss.item(), (1 + 2 + 3) / 3)
    out.loss.backward()
    assert close(lp.grad, [[-1 / 3, -1 / 3, 0], [-1 / 3, 0, 0]])
    with pytest.raises(ValueError, match="no tokens"):
        sft_loss(lp, torch.zeros(2, 3, dtype=torch.bool))


def test_ipo_value_by_hand():
    # beta 0.25 -> target 1 / (2 * 0.25) = 2
    # h0 = (-1 + 1.5) - (-3 + 2) = 1.5 ; h1 = (-2 + 2) - (-1 + 1.5) = -0.5
    # loss = ((1.5 - 2)^2 + (-0.5 - 2)^2) / 2 = (0.25 + 6.25) / 2 = 3.25
    pi_c, ref_c, pi_r, ref_r = torch.tensor([[-1.0, -2.0], [-1.5, -2.0], [-3.0, -1.0], [-2.0, -1.5]])
    out = ipo_loss(pi_c, ref_c, pi_r, ref_r, beta=0.25)
    assert close(out.loss.item(), 3.25)
    assert out.metrics["margin_mean"] == pytest.approx(0.5)
    assert out.metrics["margin_target"] == pytest.approx(2.0)
    assert out.metrics["pair_accuracy"] == pytest.approx(0.5)


def test_bonbon_value_by_hand_and_gradient_only_on_masked_tokens():
    x = 7.0  # padding value: must not matter
    chosen = torch.tensor([[-0.5, -1.0, x], [-2.0, x, x]], requires_grad=True)
    chosen_mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    rejected = torch.tensor([[-1.0, -1.0, -1.0], [-0.5, -0.5, x]], requires_grad=True)
    rejected_mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    # sequence sums: pi_c = [-1.5, -2.0], pi_r = [-3.0, -1.0]
    # h0 = (-1.5 + 2.0) - (-3.0 + 2.5) = 1.0 ; h1 = (-2.0 + 2.5) - (-1.0 + 1.5) = 0.0
    # beta 0.5 -> target 1: IPO = ((1 - 1)^2 + (0 - 1)^2) / 2 = 0.5
    # SFT = (0.5 + 1.0 + 2.0) / 3 = 3.5 / 3
    # alpha 0.2: 0.2 * 3.5 / 3 + 0.8 * 0.5
    ref_c, ref_r = torch.tensor([-2.0, -2.5]), torch.tensor([-2.5, -1.5])
    out = bonbon_loss(chosen, chosen_mask, rejected, rejected_mask, ref_c, ref_r, alpha=0.2, beta=0.5)
    assert close(out.loss.item(), 0.2 * 3.5 / 3 + 0.8 * 0.5)
    assert out.metrics["sft/loss"] == pytest.approx(3.5 / 3)
    assert out.metrics["ipo/loss"] == pytest.approx(0.5)
    out.loss.backward()
    assert (chosen.grad[chosen_mask == 0] == 0).all() and (rejected.grad[rejected_mask == 0] == 0).all()
    # d/d rejected of 0.8 * mean((h - 1)^2) with dh/d pi_r = -1: 0.8 * 2 (h - 1) * (-1) / 2 -> row 0: 0, row 1: 0.8
    assert close(rejected.grad, [[0.0, 0.0, 0.0], [0.8, 0.8, 0.0]])


def test_bonbon_beta_matches_the_best_of_n_margin():
    # 1 / (2 (n-1) H_{n-1}): n=2 -> 1/(2*1*1) = 0.5 ; n=3 -> 1/(2*2*1.5) = 1/6
    assert bonbon_beta(2) == pytest.approx(0.5)
    assert bonbon_beta(3) == pytest.approx(1 / 6)
    # n=10: H_9 = 7129/2520 -> 1 / (18 * 7129 / 2520) = 2520 / 128322
    assert bonbon_beta(10) == pytest.approx(2520 / 128322)


def test_preference_pairs_pick_best_and_worst_and_skip_ties():
    speedup = [[1.0, 2.0, 1.5, 1.2], [1.0, 1.0, 1.0], [1.3, 1.1]]
    quality = [[1.0, 0.0, 0.5, 0.9], [0.2, 0.2, 0.2], [0.0, 0.5]]
    # lambda 2: group 0 -> [3.0, 2.0, 2.5, 3.0] best = first 3.0 (index 0), worst index 1
    #           group 1 -> all 1.4: skipped
    #           group 2 -> [1.3, 2.1]: best 1, worst 0
    scores = [[latency_aware_score(s, q, 2.0) for s, q in zip(srow, qrow)] for srow, qrow in zip(speedup, quality)]
    pairs = preference_pairs(scores)
    assert (pairs.groups, pairs.chosen, pairs.rejected, pairs.num_skipped) == ([0, 2], [0, 1], [1, 0], 1)
    assert latency_aware_score(1.5, 0.4, math.inf) == 0.4  # Pasta-BoN-inf ranks by quality alone
    with pytest.raises(ValueError, match="group 1"):
        preference_pairs(torch.tensor([[1.0, 2.0], [math.nan, 0.0]]))


def test_registry_names_the_losses():
    assert LOSSES == {"grpo": grpo_loss, "bonbon": bonbon_loss, "sft": sft_loss,
                      "planned_diffusion": planned_diffusion_loss}
