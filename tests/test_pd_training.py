"""Planned Diffusion's hybrid objective (trainer.losses.planned_diffusion_loss, trainer.algorithms.PlannedDiffusion)
against values worked out by hand, and the learner's rules for span traces."""

from __future__ import annotations

import pytest
import torch

from sliderl.core.planned_diffusion import PD_TOKENS
from sliderl.core.trace import Trace
from sliderl.trainer.algorithms import PlannedDiffusion, PlannedDiffusionOptions, Row, SFTOptions, Totals
from sliderl.trainer.learner import Learner
from sliderl.trainer.losses import planned_diffusion_loss
from sliderl.trainer.sft import SFTExample, sft_trace


# catches: the diffusion term weighted t instead of 1/t (planted: 0.825), a loss on span tokens left unmasked
# (planted: the masked set = every span token -> 6.6), the normaliser counting masked tokens only (-> 7.0).
def test_hybrid_loss_by_hand():
    logprobs = torch.tensor([[-1.0, -2.0, -0.5, -3.0, -4.0]])
    ar = torch.tensor([[True, True, False, False, False]])  # two autoregressive targets
    span = torch.tensor([[False, False, True, True, True]])  # three span body tokens ...
    masked = torch.tensor([[False, False, True, False, True]])  # ... two of them masked at t = 0.25
    out = planned_diffusion_loss(logprobs, ar, span, masked, torch.tensor([0.25]))
    # -(-1 - 2 + (-0.5 - 4.0) / 0.25) / 5 tokens = (3 + 18) / 5 = 4.2
    assert out.loss.item() == pytest.approx(4.2)
    assert out.metrics["ar_nll"] == pytest.approx(1.5) and out.metrics["diffusion_nll"] == pytest.approx(2.25)
    assert out.metrics["mask_rate"] == pytest.approx(2 / 3)
    # a step's share: the same sums over a normaliser of 10 tokens -> 21 / 10
    assert planned_diffusion_loss(logprobs, ar, span, masked, torch.tensor([0.25]), num_tokens=10).loss.item() \
        == pytest.approx(2.1)
    with pytest.raises(ValueError, match="masked tokens must be span tokens"):
        planned_diffusion_loss(logprobs, ar, span, ar, torch.tensor([0.25]))


# catches: the algorithm passing kept span tokens as masked (planted: kind > 0 -> 1.7), each row not weighted by
# its own t, the step's normaliser not the loss mask's count.
def test_algorithm_loss_by_hand():
    rows = [Row(0, 0.0, "", torch.ones(4, dtype=torch.bool), None, logprobs=torch.tensor([-1.0, -2.0, -0.5, -3.0]),
                target_kind=torch.tensor([0, 0, 2, 1], dtype=torch.int8), noise_t=0.25),
            Row(1, 0.0, "", torch.ones(2, dtype=torch.bool), None, logprobs=torch.tensor([-0.2, -1.0]),
                target_kind=torch.tensor([0, 2], dtype=torch.int8), noise_t=0.5)]
    out = PlannedDiffusion().loss(rows, Totals(6, 2, 2, {0: 4, 1: 2}))
    # row 0: 1 + 2 (autoregressive) + 0.5 / 0.25 (masked); -3.0 kept: 0. row 1: 0.2 + 1.0 / 0.5. (5 + 2.2) / 6
    assert out.loss.item() == pytest.approx(1.2)


@pytest.fixture(scope="module")
def pd_model(tiny_model_factory):
    return tiny_model_factory(arch="qwen3", extra_special_tokens=PD_TOKENS)


def pd_trace(learner: Learner, index: int = 0, correct: float = 1.0) -> Trace:
    example = SFTExample("Q\n", 'a<promise topic="A" tokens="1"/><async>xyz' + "<null>" * 7 + "</async><sync/>b")
    trace = sft_trace(learner.tokenizer, example, "planned_diffusion", index)
    trace.reward_components = {"correctness": correct}
    return trace


# catches: a span trace trained by an algorithm that cannot score its spans, or cut into windows; select=correct
# keeping a wrong rollout.
def test_learner_rules_for_span_traces(pd_model):
    sft = Learner(str(pd_model), algo=SFTOptions(), window_mode="full", vocab_policy="planned_diffusion")
    with pytest.raises(ValueError, match="learner.algo.type must be planned_diffusion, got sft"):
        sft.step([[pd_trace(sft)]])
    cut = Learner(str(pd_model), algo=PlannedDiffusionOptions(), window_mode="truncated", window=4,
                  vocab_policy="planned_diffusion")
    with pytest.raises(ValueError, match="planned_diffusion, which trains on the whole trace only"):
        cut.step([[pd_trace(cut)]])
    learner = Learner(str(pd_model), algo=PlannedDiffusionOptions(select="correct"), window_mode="full",
                      vocab_policy="planned_diffusion")
    groups = [[pd_trace(learner, 0, 1.0), pd_trace(learner, 1, 0.0)], [pd_trace(learner, 2, 0.0)]]
    sel = learner.algorithm.select(groups)
    assert [t.trace_id for t in sel.traces] == ["sft-0"] and sel.metrics["no_correct_groups"] == 1
    metrics = learner.step([[pd_trace(learner)]])
    # loss tokens: "a" and the promise, then <sync/>, b, eos (autoregressive); the 10 body tokens (diffusion)
    assert metrics.stepped and 0 <= metrics.algorithm["mask_rate"] <= 1.0
    assert metrics.num_loss_tokens == len(learner.tokenizer('a<promise topic="A" tokens="1"/>').input_ids) + 3 + 10
