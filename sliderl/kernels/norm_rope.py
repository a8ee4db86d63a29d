"""Fused RMSNorm (with the residual add before it), q/k-norm + RoPE and SiLU·mul: one launch where PyTorch needs
~2-30.

The decoder's inference path uses these; ``core.model``'s PyTorch ops stay the training path and
the reference. Both kernels round where those ops round: the norm runs in fp32 and is cast to the
dtype before the weight multiply (as transformers does), and every elementwise op of RoPE is rounded
to the dtype, as each separate torch op rounds its bf16 result. FMA contraction is off for the same
reason: torch never fuses a product into the following add. Launchers check arguments without
synchronising, so they can be captured in CUDA graphs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sliderl.kernels.launch_checks import next_pow2
from sliderl.kernels.pdl import check_pdl, launch_options, wait_then_release

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def round_to(x, DTYPE: tl.constexpr):
    """fp32 ``x`` rounded to DTYPE as torch casts (to nearest, ties to even) and widened back to fp32."""
    if DTYPE == tl.bfloat16:  # by bits (NaN aside): the interpreter's fp32 -> bf16 cast truncates
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    return x.to(DTYPE).to(tl.float32)


@triton.jit
def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr,
                     stride_x, stride_r, stride_o, stride_ro, dim, eps,
                     BLOCK: tl.constexpr, ADD_RESIDUAL: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < dim
    dtype = out_ptr.dtype.element_ty
    w = tl.load(weight_ptr + cols, mask=ok, other=0.0).to(tl.float32)  # a parameter: loaded before the wait
    wait_then_release(PDL)
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    if ADD_RESIDUAL:  # the layer's `h = h + x`, rounded to the dtype: it is the next residual
        r = tl.load(residual_ptr + row * stride_r + cols, mask=ok, other=0.0).to(tl.float32)
        x = round_to(x + r, dtype)
        tl.store(residual_out_ptr + row * stride_ro + cols, x.to(dtype), mask=ok)
    inv = tl.math.rsqrt(tl.sum(x * x, axis=0) / dim + eps)
    out = round_to(round_to(x * inv, dtype) * w, dtype)
    tl.store(out_ptr + row * stride_o + cols, out.to(dtype), mask=ok)


@triton.jit
def _norm_rope_heads(x_ptr, out_ptr, weight_ptr, tok, stride_n, stride_h, stride_on, stride_oh,
                     cos1, sin1, cos2, sin2, eps,
                     NUM_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
                     NORM: tl.constexpr):
    """One token's heads ``[NUM_HEADS, 2 * HALF]``: optional RMSNorm, then rotate-half RoPE, stored to out."""
    h = tl.arange(0, HEADS_PAD)[:, None]
    d = tl.arange(0, HALF_PAD)[None, :]
    ok = (h < NUM_HEADS) & (d < HALF)
    dtype = out_ptr.dtype.element_ty
    src = x_ptr + tok * stride_n + h * stride_h + d
    x1 = tl.load(src, mask=ok, other=0.0).to(tl.float32)  # [HEADS_PAD, HALF_PAD], first half of each head
    x2 = tl.load(src + HALF, mask=ok, other=0.0).to(tl.float32)
    if NORM:
        ms = (tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF)
        inv = tl.math.rsqrt(ms + eps)[:, None]
        w1 = tl.load(weight_ptr + d, mask=d < HALF, other=0.0).to(tl.float32)
        w2 = tl.load(weight_ptr + HALF + d, mask=d < HALF, other=0.0).to(tl.float32)
        x1 = round_to(round_to(x1 * inv, dtype) * w1, dtype)
        x2 = round_to(round_to(x2 * inv, dtype) * w2, dtype)
    # x * cos + rotate_half(x) * sin with rotate_half(x) = [-x2, x1]; each product and the sum rounded
    out1 = round_to(round_to(x1 * cos1, dtype) - round_to(x2 * sin1, dtype), dtype)
    out2 = round_to(round_to(x2 * cos2, dtype) + round_to(x1 * sin2, dtype), dtype)
    dst = out_ptr + tok * stride_on + h * stride_oh + d
    tl.store(dst, out1.to(dtype), mask=ok)
    tl.store(dst + HALF, out2.to(dtype), mask=ok)


@triton.jit
def _qk_norm_rope_kernel(q_ptr, k_ptr, q_out_ptr, k_out_ptr, q_weight_ptr, k_weight_ptr, cos_ptr, sin_ptr,
                         stride_qn, stride_qh, stride_kn, stride_kh, stride_qon, stride_qoh, stride_kon, stride_koh,
                         stride_cn, stride_sn, eps,
                         Q_HEADS: tl.constexpr, Q_HEADS_PAD: tl.constexpr, KV_HEADS: tl.constexpr,
                         KV_HEADS_PAD: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr, NORM: tl.constexpr,
                         PDL: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    wait_then_release(PDL)
    d = tl.arange(0, HALF_PAD)[None, :]
    ok = d < HALF
    cos1 = tl.load(cos_ptr + tok * stride_cn + d, mask=ok, other=0.0).to(tl.float32)  # [1, HALF_PAD]
    cos2 = tl.load(cos_ptr + tok * stride_cn + HALF + d, mask=ok, other=0.0).to(tl.float32)
    sin1 = tl.load(sin_ptr + tok * stride_sn + d, mask=ok, other=0.0).to(tl.float32)
    sin2 = tl.load(sin_ptr + tok * stride_sn + HALF + d, mask=ok, other=0.0).to(tl.float32)
    _norm_rope_heads(q_ptr, q_out_ptr, q_weight_ptr, tok, stride_qn, stride_qh, stride_qon, stride_qoh,
                     cos1, sin1, cos2, sin2, eps, Q_HEADS, Q_HEADS_PAD, HALF, HALF_PAD, NORM)
    _norm_rope_heads(k_ptr, k_out_ptr, k_weight_ptr, tok, stride_kn, stride_kh, stride_kon, stride_koh,
                     cos1, sin1, cos2, sin2, eps, KV_HEADS, KV_HEADS_PAD, HALF, HALF_PAD, NORM)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             pdl: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``RMSNorm.forward`` of ``x [N, D]`` in one launch; ``weight [D]`` of x's dtype.

    With ``residual [N, D]``: returns ``(rms_norm(x + residual), x + residual)``, the sum rounded to
    the dtype as torch's add rounds it. ``pdl``: part of a PDL chain (``kernels.pdl``).
    """
    if x.dim() != 2 or x.dtype not in FLOAT_DTYPES or x.stride(-1) != 1:
        raise ValueError(f"x must be [N, D] of {FLOAT_DTYPES} with a contiguous last dim, "
                         f"got {x.dtype} {tuple(x.shape)} with strides {x.stride()}")
    n, dim = x.shape
    _check_like("weight", weight, (dim,), x)
    out = torch.empty_like(x)
    new_residual = out
    if residual is not None:
        _check_like("residual", residual, (n, dim), x)
        new_residual = torch.empty_like(x)
    if n > 0:
        block = next_pow2(dim)
        r = x if residual is None else residual
        _rms_norm_kernel[(n,)](
            x, r, weight, out, new_residual, x.stride(0), r.stride(0), out.stride(0), new_residual.stride(0),
            dim, eps, BLOCK=block, ADD_RESIDUAL=residual is not None, PDL=check_pdl(pdl, x.device),
            num_warps=min(8, max(1, block // 256)), enable_fp_fusion=False, **launch_options(pdl))
    return out if residual is None else (out, new_residual)


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None,
                 eps: float = 1e-6, pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3's per-head RMSNorm (when ``q_weight``/``k_weight [D]`` are given), then rotate-half RoPE.

    q: [N, H_q, D], k: [N, H_kv, D], cos/sin: [N, D], all of one dtype -> new (q, k). Equals
    ``apply_rope(q_norm(q), cos, sin), apply_rope(k_norm(k), cos, sin)`` of ``core.model``.
    ``pdl``: part of a PDL chain (``kernels.pdl``).
    """
    if q.dim() != 3 or k.dim() != 3 or q.dtype not in FLOAT_DTYPES:
        raise ValueError(f"q and k must be [N, H, D] of {FLOAT_DTYPES}, got {q.dtype} {tuple(q.shape)} "
                         f"and {k.dtype} {tuple(k.shape)}")
    n, h_q, dim = q.shape
    h_kv = k.shape[1]
    if dim % 2:
        raise ValueError(f"rotate-half RoPE needs an even head dim, got {dim}")
    _check_like("q", q, (n, h_q, dim), q)
    _check_like("k", k, (n, h_kv, dim), q)
    _check_like("cos", cos, (n, dim), q)
    _check_like("sin", sin, (n, dim), q)
    if (q_weight is None) != (k_weight is None):
        raise ValueError("q_weight and k_weight must be given together (Qwen3's q_norm/k_norm) or not at all")
    norm = q_weight is not None
    if norm:
        _check_like("q_weight", q_weight, (dim,), q)
        _check_like("k_weight", k_weight, (dim,), q)
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    if n > 0:
        _qk_norm_rope_kernel[(n,)](
            q, k, q_out, k_out, q_weight if norm else q, k_weight if norm else k, cos, sin,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), q_out.stride(0), q_out.stride(1),
            k_out.stride(0), k_out.stride(1), cos.stride(0), sin.stride(0), eps,
            Q_HEADS=h_q, Q_HEADS_PAD=next_pow2(h_q), KV_HEADS=h_kv, KV_HEADS_PAD=next_pow2(h_kv),
            HALF=dim // 2, HALF_PAD=next_pow2(dim // 2), NORM=norm, PDL=check_pdl(pdl, q.device), num_warps=4,
            enable_fp_fusion=False, **launch_options(pdl))
    return q_out, k_out


def _check_like(name: str, t: torch.Tensor, shape: tuple[int, ...], like: torch.Tensor) -> None:
    """``t`` has ``shape``, ``like``'s dtype and device, and a contiguous last dim."""
    if tuple(t.shape) != shape or t.dtype != like.dtype or t.device != like.device or t.stride(-1) != 1:
        raise ValueError(f"{name} must be {like.dtype} {shape} on {like.device} with a contiguous last dim, "
                         f"got {t.dtype} {tuple(t.shape)} on {t.device} with strides {t.stride()}")


@triton.jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, stride_in, stride_out, inter, BLOCK: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < inter
    dtype = out_ptr.dtype.element_ty
    wait_then_release(PDL)
    gate = tl.load(gate_up_ptr + row * stride_in + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * stride_in + inter + cols, mask=ok, other=0.0).to(tl.float32)
    out = round_to(round_to(gate / (1.0 + tl.exp(-gate)), dtype) * up, dtype)  # torch's silu, then its multiply
    tl.store(out_ptr + row * stride_out + cols, out.to(dtype), mask=ok)


def silu_mul(gate_up: torch.Tensor, pdl: bool = False) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up [N, 2I]`` (gate then up, side by side: ``FusedLinears.joined`` of a SwiGLU
    MLP) in one launch -> ``[N, I]``, each op rounded to the dtype as the two torch ops round it."""
    if gate_up.dim() != 2 or gate_up.dtype not in FLOAT_DTYPES or gate_up.stride(-1) != 1 or gate_up.shape[1] % 2:
        raise ValueError(f"gate_up must be [N, 2I] of {FLOAT_DTYPES} with a contiguous last dim, got "
                         f"{gate_up.dtype} {tuple(gate_up.shape)} with strides {gate_up.stride()}")
    n, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((n, inter), dtype=gate_up.dtype, device=gate_up.device)
    if n > 0:
        block = min(1024, next_pow2(inter))
        _silu_mul_kernel[(n, triton.cdiv(inter, block))](
            gate_up, out, gate_up.stride(0), out.stride(0), inter, BLOCK=block, PDL=check_pdl(pdl, gate_up.device),
            num_warps=4, enable_fp_fusion=False, **launch_options(pdl))
    return out
