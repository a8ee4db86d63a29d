"""Fused RMSNorm and q/k-norm + RoPE (``kernels.norm_rope``) against the PyTorch ops of ``core.model``.

On CPU these run under ``TRITON_INTERPRET=1`` at small shapes (odd token counts, head counts and
hidden sizes that are not powers of two); ``gpu`` tests repeat them at the Qwen3-1.7B shape.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before kernels.norm_rope imports triton

from sliderl.core.loader import load_model
from sliderl.core.model import DenseAttention, RMSNorm, apply_rope, causal_mask
from sliderl.kernels.norm_rope import qk_norm_rope, rms_norm, silu_mul

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-6


def randn(*shape, dtype, scale=3.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(DEVICE, dtype)


def norm_weight(dim, dtype, seed):
    return 1 + randn(dim, dtype=torch.float32, scale=0.1, seed=seed).to(dtype)


def reference_norm(x, weight):
    norm = RMSNorm(weight.shape[0], EPS).to(DEVICE, weight.dtype)
    norm.weight.data.copy_(weight)
    return norm(x)


def assert_matches(out, ref):
    """fp32: within 1e-5 relative. bf16/fp16: torch's rounding points reproduced, i.e. at least 99% of
    the elements bit-equal and the rest within 1e-2 of the largest. (Rounding once after an fp32 RoPE
    leaves ~66% bit-equal, rounding the norm after the weight multiply instead of before ~75%.)"""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
        return
    equal = (out == ref).float().mean().item()
    assert equal >= 0.99, f"only {equal:.1%} of the elements equal torch's"
    assert (out.float() - ref.float()).abs().max() <= 1e-2 * ref.float().abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [16, 96])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_the_model_rmsnorm(dtype, dim, with_residual):
    x, w = randn(13, dim, dtype=dtype), norm_weight(dim, dtype, seed=1)
    with torch.no_grad():
        if not with_residual:
            assert_matches(rms_norm(x, w, EPS), reference_norm(x, w))
            return
        residual = randn(13, dim, dtype=dtype, scale=1.0, seed=2)
        out, new_residual = rms_norm(x, w, EPS, residual)
        assert torch.equal(new_residual, residual + x)  # one rounded add either way
        assert_matches(out, reference_norm(residual + x, w))


def reference_qk(q, k, cos, sin, q_weight, k_weight):
    if q_weight is not None:
        q, k = reference_norm(q, q_weight), reference_norm(k, k_weight)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim,h_q,h_kv", [(16, 4, 2), (32, 6, 2), (64, 3, 3)])
@pytest.mark.parametrize("with_norm", [False, True])
def test_qk_norm_rope_matches_norm_then_apply_rope(dtype, dim, h_q, h_kv, with_norm):
    n = 11
    q, k = randn(n, h_q, dim, dtype=dtype, seed=1), randn(n, h_kv, dim, dtype=dtype, seed=2)
    # cos/sin with unequal halves, so a kernel that mixes up the halves fails
    cos, sin = (randn(n, dim, dtype=torch.float32, scale=1.0, seed=s).clamp(-1, 1).to(dtype) for s in (3, 4))
    weights = (norm_weight(dim, dtype, seed=5), norm_weight(dim, dtype, seed=6)) if with_norm else (None, None)
    with torch.no_grad():
        out_q, out_k = qk_norm_rope(q, k, cos, sin, *weights, eps=EPS)
        ref_q, ref_k = reference_qk(q, k, cos, sin, *weights)
    assert_matches(out_q, ref_q)
    assert_matches(out_k, ref_k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inter", [24, 1500])  # 1500: two column blocks of 1024, the second partly masked
def test_silu_mul_matches_silu_then_multiply(dtype, inter):
    # catches: gate and up swapped (silu(up) * gate), the up half read at the wrong offset, a masked tail column
    # written or read out of range (inter 1500 is not a multiple of the block), and the product not rounded as
    # torch rounds silu's bf16 result before the multiply (bf16: < 99% bit-equal)
    gate_up = randn(9, 2 * inter, dtype=dtype, scale=2.0, seed=7)
    with torch.no_grad():
        gate, up = gate_up.split(inter, dim=-1)
        assert_matches(silu_mul(gate_up), torch.nn.functional.silu(gate) * up)


def test_launchers_name_the_bad_argument():
    x, w = randn(5, 16, dtype=torch.float32), norm_weight(16, torch.float32, seed=1)
    with pytest.raises(ValueError, match="weight must be torch.float32 \\(16,\\)"):
        rms_norm(x, w[:8], EPS)
    with pytest.raises(ValueError, match="residual must be"):
        rms_norm(x, w, EPS, x.to(torch.bfloat16))
    with pytest.raises(ValueError, match="x must be \\[N, D\\]"):
        rms_norm(x.t(), w, EPS)  # last dim not contiguous
    q, k = randn(5, 4, 16, dtype=torch.float32), randn(5, 2, 16, dtype=torch.float32)
    cos = sin = randn(5, 16, dtype=torch.float32)
    with pytest.raises(ValueError, match="even head dim, got 15"):
        qk_norm_rope(q[..., :15], k[..., :15], cos[:, :15], sin[:, :15])
    with pytest.raises(ValueError, match="cos must be torch.float32 \\(5, 16\\)"):
        qk_norm_rope(q, k, cos[:4], sin)
    with pytest.raises(ValueError, match="given together"):
        qk_norm_rope(q, k, cos, sin, q_weight=w)
    with pytest.raises(ValueError, match="gate_up must be \\[N, 2I\\]"):
        silu_mul(x[:, :15])  # an odd width has no gate and up halves


def forward_logits(model, ids, fused):
    model.fused_kernels = fused
    n = ids.numel()
    return model.compute_logits(model(ids, torch.arange(n, device=DEVICE), DenseAttention(causal_mask(n))))


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_fused_decoder_forward_equals_the_pytorch_forward(tiny_model_factory, arch):
    model = load_model(tiny_model_factory(arch), device=DEVICE)  # fp32
    ids = torch.randint(0, 256, (19,), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    with torch.inference_mode():
        torch.testing.assert_close(forward_logits(model, ids, True), forward_logits(model, ids, False),
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_fused_gemv_forward_equals_the_pytorch_forward(tiny_model_factory, arch):
    # catches: the decode path with every linear a GEMV (``gemv_kernels``, at most GEMV_MAX_TOKENS rows) computing
    # another MLP or residual stream than PyTorch's layer: the MLP tail's silu_mul + down GEMV taking gate and up
    # swapped, the residual added twice or dropped (the tail adds it inside the down GEMV), a GEMV given another
    # layer's weight. Independent reference: the model's plain PyTorch forward (SiLU, mul, F.linear, adds).
    model = load_model(tiny_model_factory(arch), device=DEVICE)  # fp32
    ids = torch.randint(0, 256, (5,), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    model.gemv_kernels = True
    with torch.inference_mode():
        torch.testing.assert_close(forward_logits(model, ids, True), forward_logits(model, ids, False),
                                   rtol=1e-5, atol=1e-5)


def test_fused_forward_runs_no_residual_add_or_silu_mul_kernel_of_its_own(tiny_model_factory):
    # catches: the fused (inference) forward adding a layer's MLP output to its residual stream in a kernel of its
    # own, or running SiLU·mul as torch's two kernels (launches per layer at batch 1, where a step's time is its
    # launches), and a residual the next norm drops or adds twice (the forward test above then fails). Counted at the aten level: an add producing a
    # [tokens, hidden] tensor is such a kernel; the layers' residual adds all belong to the norms' launches.
    from torch.utils._python_dispatch import TorchDispatchMode

    model = load_model(tiny_model_factory("llama"), device=DEVICE)
    ids = torch.randint(0, 256, (7,), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    hidden, inter = model.config.hidden_size, model.config.intermediate_size

    class CountAdds(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten.add.Tensor and tuple(out.shape) == (7, hidden):
                CountAdds.count += 1
            if func in (torch.ops.aten.silu.default, torch.ops.aten.mul.Tensor) and out.shape[-1] == inter:
                CountAdds.count += 100  # SiLU·mul as torch ops (two kernels) instead of silu_mul's one
            return out

    with torch.inference_mode(), CountAdds():
        forward_logits(model, ids, True)
    fused_adds = CountAdds.count
    with torch.inference_mode(), CountAdds():
        forward_logits(model, ids, False)
    # eager: 2 adds (after attention, after the MLP) and SiLU, mul a layer
    assert fused_adds == 0 and CountAdds.count - fused_adds == 202 * model.config.num_layers


def test_fused_kernels_leave_training_to_pytorch(tiny_model_factory):
    """With autograd on, the switch changes nothing: the same loss and the same gradients."""
    model = load_model(tiny_model_factory("qwen3"), device=DEVICE)
    ids = torch.randint(0, 256, (9,), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    grads = []
    for fused in (False, True):
        model.zero_grad()
        forward_logits(model, ids, fused).logsumexp(-1).sum().backward()
        grads.append({name: p.grad.clone() for name, p in model.named_parameters()})
    for name, grad in grads[0].items():
        assert torch.equal(grads[1][name], grad), name


QWEN3_1_7B = {"tokens": 256, "hidden": 2048, "q_heads": 16, "kv_heads": 8, "head_dim": 128}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_at_qwen3_1_7b_shape(dtype):
    n, hidden = QWEN3_1_7B["tokens"], QWEN3_1_7B["hidden"]
    x, residual, w = randn(n, hidden, dtype=dtype), randn(n, hidden, dtype=dtype, seed=1), norm_weight(hidden, dtype, 2)
    with torch.no_grad():
        assert_matches(rms_norm(x, w, EPS), reference_norm(x, w))
        out, new_residual = rms_norm(x, w, EPS, residual)
        assert torch.equal(new_residual, residual + x)
        assert_matches(out, reference_norm(residual + x, w))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qk_norm_rope_at_qwen3_1_7b_shape(dtype):
    n, h_q, h_kv, dim = (QWEN3_1_7B[key] for key in ("tokens", "q_heads", "kv_heads", "head_dim"))
    q, k = randn(n, h_q, dim, dtype=dtype), randn(n, h_kv, dim, dtype=dtype, seed=1)
    # RoPE at decode positions of long traces, as RotaryEmbedding computes it (theta 1e6)
    positions = torch.randint(0, 40000, (n,), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, dim, 2, dtype=torch.float32, device=DEVICE) / dim))
    emb = (positions.float()[:, None] * inv_freq).repeat(1, 2)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    weights = norm_weight(dim, dtype, seed=3), norm_weight(dim, dtype, seed=4)
    with torch.no_grad():
        for w in (weights, (None, None)):
            out_q, out_k = qk_norm_rope(q, k, cos, sin, *w, eps=EPS)
            ref_q, ref_k = reference_qk(q, k, cos, sin, *w)
            assert_matches(out_q, ref_q)
            assert_matches(out_k, ref_k)
