"""``LearnerArgs.master_weights``: a bf16 learner whose AdamW steps float32 masters (``trainer.optimizer``)."""

from __future__ import annotations

import torch

from sliderl.core.trace import Trace
from sliderl.trainer.learner import Learner
from sliderl.trainer.optimizer import MasterAdamW


def _steps(optimizer_cls, n: int) -> torch.Tensor:
    w = torch.nn.Parameter(torch.full((4,), 0.02).bfloat16())
    opt = optimizer_cls([w], lr=1e-6, weight_decay=0.0)
    for _ in range(n):
        opt.zero_grad()
        w.grad = torch.ones_like(w)
        opt.step()
    return w.detach()


def test_master_weights_keep_the_updates_a_bf16_adamw_rounds_away():
    # catches: a bf16 learner that never moves its weights at RL learning rates (the bug: AdamW's update
    # is computed and stored in bf16), and masters that are not stepped or not written back.
    # By hand: a constant gradient g gives AdamW's bias-corrected m = g and v = g^2, so each step moves the
    # weight by lr * g / (|g| + eps) = 1e-6. w0 = bf16(0.02) = 0.0200195 (= 2^-6 + 36 * 2^-13; bf16's
    # spacing in [2^-6, 2^-5) is 2^-13 = 1.22e-4), so 1e-6 is far below half a spacing and bf16 AdamW
    # keeps w0 forever; 100 float32 steps reach 0.0199195 = 2^-6 + 35.18 * 2^-13, which rounds to 35 * 2^-13.
    w0 = torch.tensor(0.02).bfloat16()
    assert torch.equal(_steps(torch.optim.AdamW, 100), w0.expand(4))
    expected = torch.tensor(2**-6 + 35 * 2**-13).bfloat16()
    assert torch.equal(_steps(MasterAdamW, 100), expected.expand(4))


def _group() -> list[list[Trace]]:
    gen = torch.Generator().manual_seed(0)
    traces = [Trace(f"t{i}", "g", "p", 0, 0, "prefix_sliding:8", torch.randint(0, 256, (6,), generator=gen).tolist(),
                    torch.randint(0, 256, (12,), generator=gen).tolist(), [-5.0] * 12, "length", reward=float(i))
              for i in range(2)]
    return [traces]


def test_a_bf16_learner_with_masters_checkpoints_them_and_resumes_from_the_unrounded_values(tiny_model_factory, tmp_path):
    # catches: a checkpoint without the masters (a resume would restart from the bf16-rounded weights and
    # lose every update still below a bf16 spacing), masters not created for a bf16 model, and a learner
    # whose model grads are never cleared (the optimizer's zero_grad reaching the masters only)
    learner = Learner(str(tiny_model_factory(arch="qwen3")), dtype="bfloat16", master_weights=True, lr=1e-6)
    assert isinstance(learner.optimizer, MasterAdamW)
    learner.step(_group())
    masters = [m.clone() for m in learner.optimizer.masters]
    params = [p.detach().float() for p in learner.model.parameters()]
    assert any(not torch.equal(m, p) for m, p in zip(masters, params))  # sub-spacing updates live in the masters
    learner.save_checkpoint(tmp_path / "ckpt")
    resumed = Learner.from_checkpoint(tmp_path / "ckpt")
    assert all(torch.equal(a, b) for a, b in zip(masters, resumed.optimizer.masters))
    learner.step(_group())
    resumed.step(_group())
    # identical second steps: the learner's model grads from step 1 were cleared (the resumed one has none)
    assert all(torch.equal(a, b) for a, b in zip(learner.optimizer.masters, resumed.optimizer.masters))
