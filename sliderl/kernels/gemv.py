"""Skinny GEMM for decode at small batch: ``y [M, N] = x [M, K] @ W [N, K]^T (+ bias)``, M <= 16.

At M = 1..8 a linear layer is a read of W: every weight is used M times, so the time is the bytes of
W over the memory bandwidth. Here each W element is read exactly once for all M rows of x. Program
(tile, split) owns ``BLOCK_N`` output features — rows of W — and one split of K; it streams its
``[BLOCK_N, BLOCK_K]`` tiles of W (K-contiguous, so 16-byte loads; ``num_stages`` tiles in flight)
and multiplies each by all rows of x at once with ``tl.dot``, x padded to 16 rows (the tensor cores
idle; the loads are what count), accumulating in fp32.

Enough programs to fill the GPU come from ``BLOCK_N`` when N is large and from split-K when it is
not (o_proj and down_proj: N = hidden). Splits store fp32 partials; the last split of a tile to
arrive (an acq_rel counter, as in ``kernels.decode``) sums them *in split order* and writes y — one
launch, and the same bits whichever split arrives last, which fp32 atomics into y would not give.
Launch shapes come from ``gemv_config``, a fixed function of the shape: no autotuning, so nothing is
benchmarked during CUDA-graph capture and every process picks the same reduction order. Launchers
check arguments without synchronising, so they can be captured.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from sliderl.kernels.decode import choose_num_splits, num_sms, split_counters
from sliderl.kernels.launch_checks import interpreting, next_pow2
from sliderl.kernels.norm_rope import round_to
from sliderl.kernels.pdl import LINE_BYTES, check_pdl, launch_options, line_elems, prefetch_l2, wait_then_release

MAX_ROWS = 16  # rows of x one launch takes: x is padded to this for tl.dot
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
W_TILE_BYTES = 16384  # bytes of W per pipeline stage of one program
# the MLP tail (``swiglu``) also holds its gate and up tiles, and SiLU's float32 temporaries, for every padded row:
# at 16 KB of W a stage (block 16 x 512 at down_proj's shape) ptxas spills 12-15 KB a thread for sm_90 (triton 3.6 /
# 3.9), at 8 KB (16 x 256) still 8 bytes with triton 3.6; at 4 KB (16 x 128) it needs 92 registers and spills
# nothing with either, and 6 stages keep 24 KB of W in flight per program (benchmarks/kernel_compile_report.py at
# the H200's shapes)
SWIGLU_W_TILE_BYTES = 4096
SWIGLU_STAGES = 6
BLOCK_NS = (64, 32, 16)  # tried largest first; 16 is tl.dot's minimum
PREFETCH_BYTES = 65536  # with pdl: bytes of its W slice each program asks L2 for before it waits (at most)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, bias_ptr, residual_ptr, out_ptr, part_ptr, counter_ptr, m, n, k, k_per_split,
                 stride_xm, stride_wn, stride_rm, stride_om,
                 M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_SPLITS: tl.constexpr,
                 HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                 SWIGLU: tl.constexpr, RESIDUAL: tl.constexpr, PDL: tl.constexpr, PREFETCH_LINES: tl.constexpr,
                 LINE: tl.constexpr):
    tile = tl.program_id(0)
    split = tl.program_id(1)
    rows = tl.arange(0, M_PAD)  # rows of x and of y
    cols = (tile * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)  # output features = rows of W
    kk = tl.arange(0, BLOCK_K)
    row_ok = rows < m
    col_ok = cols < n
    k_lo = split * k_per_split  # k_per_split is a multiple of BLOCK_K
    k_hi = tl.minimum(k_lo + k_per_split, k)
    if PDL:  # W is no earlier kernel's output: ask L2 for the first lines of this program's slice before waiting
        line = k_lo + tl.arange(0, PREFETCH_LINES) * LINE
        line = tl.where(line < k_hi, line, k_lo)  # past the slice: the first line again (valid, and cached)
        prefetch_l2(w_ptr + tl.where(col_ok, cols, 0)[:, None] * stride_wn + line[None, :])
    wait_then_release(PDL)
    x_ptrs = x_ptr + rows[:, None] * stride_xm + (k_lo + kk)[None, :]  # [M_PAD, BLOCK_K]
    w_ptrs = w_ptr + cols[:, None] * stride_wn + (k_lo + kk)[None, :]  # [BLOCK_N, BLOCK_K]
    acc = tl.zeros([M_PAD, BLOCK_N], dtype=tl.float32)
    for start in range(k_lo, k_hi, BLOCK_K):
        if EVEN_K:  # masks constant along K keep the loads vectorised
            x_mask = row_ok[:, None]
            w = tl.load(w_ptrs, mask=col_ok[:, None], other=0.0)
        else:
            k_ok = (start + kk) < k_hi
            x_mask = row_ok[:, None] & k_ok[None, :]
            w = tl.load(w_ptrs, mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        x = tl.load(x_ptrs, mask=x_mask, other=0.0)
        if SWIGLU:  # x holds [gate | up] (each K wide): the input is silu(gate) * up, each op rounded as torch's
            up = tl.load(x_ptrs + k, mask=x_mask, other=0.0).to(tl.float32)
            gate = x.to(tl.float32)
            x = round_to(round_to(gate / (1.0 + tl.exp(-gate)), w.dtype) * up, w.dtype)
            if not UPCAST:
                x = x.to(w.dtype)
        if UPCAST:  # the interpreter multiplies bf16 as integers: run its dots in fp32
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)  # [M_PAD, BLOCK_N]
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K

    ok = row_ok[:, None] & col_ok[None, :]
    if NUM_SPLITS == 1:
        _store_output(acc, bias_ptr, residual_ptr, out_ptr, rows, cols, col_ok, ok, stride_rm, stride_om, HAS_BIAS,
                      RESIDUAL)
    else:
        # Publish this split's partial; the last split of the tile to arrive sums them all in split
        # order. The barrier orders every thread's stores before the release atomic.
        tl.store(part_ptr + (split * m + rows[:, None]) * n + cols[None, :], acc, mask=ok)
        tl.debug_barrier()
        counter = counter_ptr + tile
        if tl.atomic_add(counter, 1, sem="acq_rel") == NUM_SPLITS - 1:
            total = tl.zeros([M_PAD, BLOCK_N], dtype=tl.float32)
            for j in tl.static_range(NUM_SPLITS):  # .cg: read the other programs' partials from L2
                total += tl.load(part_ptr + (j * m + rows[:, None]) * n + cols[None, :], mask=ok, other=0.0,
                                 cache_modifier=".cg")
            _store_output(total, bias_ptr, residual_ptr, out_ptr, rows, cols, col_ok, ok, stride_rm, stride_om,
                          HAS_BIAS, RESIDUAL)
            tl.store(counter, 0)  # every launch leaves the counters zero for the next one


@triton.jit
def _store_output(acc, bias_ptr, residual_ptr, out_ptr, rows, cols, col_ok, ok, stride_rm, stride_om,
                  HAS_BIAS: tl.constexpr, RESIDUAL: tl.constexpr):
    """y = acc (+ bias, added in fp32), cast once to the output dtype; then + residual, rounded again (torch's
    ``residual + linear(x)`` rounds the linear's output before the add)."""
    dtype = out_ptr.dtype.element_ty
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if RESIDUAL:
        r = tl.load(residual_ptr + rows[:, None] * stride_rm + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        acc = round_to(round_to(acc, dtype) + r, dtype)
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], acc.to(dtype), mask=ok)


@dataclass(frozen=True)
class GemvConfig:
    """Launch shape: output features and K elements per tile, K splits, warps, pipeline depth."""

    block_n: int
    block_k: int
    num_splits: int
    num_warps: int = 4
    num_stages: int = 4


def gemv_config(n: int, k: int, dtype: torch.dtype, device: torch.device, swiglu: bool = False) -> GemvConfig:
    """Default launch shape for ``W [N, K]`` (M does not change it: x is padded to 16 rows anyway).

    ``BLOCK_N``: the largest of 64/32/16 that still gives one tile per multiprocessor; when even 16
    does not (N = 2048 on an H200's 132), split K to fill two programs per multiprocessor
    (``choose_num_splits``). ``BLOCK_K``: ``W_TILE_BYTES`` of W per stage (``SWIGLU_W_TILE_BYTES`` and
    ``SWIGLU_STAGES`` for the MLP tail, ``gemv(swiglu=True)``). Not yet swept on the GPU: ``benchmarks/gemv.py
    --sweep`` times the neighbours of this choice.
    """
    elem = torch.empty((), dtype=dtype).element_size()
    sms = num_sms(device)
    block_n = next((b for b in BLOCK_NS if triton.cdiv(n, b) >= sms), BLOCK_NS[-1])
    tile_bytes = SWIGLU_W_TILE_BYTES if swiglu else W_TILE_BYTES
    block_k = max(16, min(tile_bytes // (block_n * elem), next_pow2(k)))
    tiles, chunks = triton.cdiv(n, block_n), triton.cdiv(k, block_k)
    splits = 1 if tiles >= sms else choose_num_splits(tiles, chunks, sms, programs_per_sm=2)
    return GemvConfig(block_n=block_n, block_k=block_k, num_splits=splits, num_stages=SWIGLU_STAGES if swiglu else GemvConfig.num_stages)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         config: GemvConfig | None = None, *, swiglu: bool = False, residual: torch.Tensor | None = None,
         pdl: bool = False) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for ``x [M, K]`` with M <= ``MAX_ROWS``: ``[M, N]`` in x's dtype.

    ``weight [N, K]`` and ``bias [N]`` share x's dtype and device; rows of x and W may be strided,
    their K dim must be contiguous. fp32 accumulation; the bias is added in fp32 before the one cast.
    ``config`` overrides ``gemv_config``. Two more ops can ride on the launch:

    - ``swiglu``: x is ``[M, 2K]``, gate then up (the fused gate/up GEMV's output), and the input is
      ``silu(gate) * up``, each op rounded to the dtype as torch rounds it (not used by the engine: on the H200
      its SiLU temporaries cap the tile, 92 us at down_proj's shape against 12.4 for ``silu_mul`` + a plain GEMV;
      ``benchmarks/gemv.py``);
    - ``residual [M, N]``: returns ``residual + y``, y rounded first (the layer's ``h + mlp(x)``).

    ``pdl``: launched as part of a programmatic-dependent-launch chain (``kernels.pdl``; Hopper or later).
    """
    if swiglu:
        if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != 2 * weight.shape[1]:
            raise ValueError(f"swiglu needs x of [M, 2K = {2 * weight.shape[-1]}] (gate then up) for weight "
                             f"{tuple(weight.shape)}, got {tuple(x.shape)}")
        check_gemv(x[:, :weight.shape[1]], weight, bias)
    else:
        check_gemv(x, weight, bias)
    m, (n, k) = x.shape[0], weight.shape
    if residual is not None and (residual.shape != (m, n) or residual.dtype != x.dtype or residual.stride(-1) != 1
                                 or residual.device != x.device):
        raise ValueError(f"residual must be {x.dtype} [{m}, {n}] on {x.device} with a contiguous last dim, got "
                         f"{residual.dtype} {tuple(residual.shape)} on {residual.device} strides {residual.stride()}")
    pdl = check_pdl(pdl, x.device)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    cfg = config or gemv_config(n, k, weight.dtype, x.device, swiglu)
    _check_config(cfg)
    tiles, splits = triton.cdiv(n, cfg.block_n), cfg.num_splits
    k_per_split, prefetch_lines, line = split_layout(cfg, k, weight.dtype)
    part = torch.empty((splits, m, n), dtype=torch.float32, device=x.device) if splits > 1 else out
    counters = split_counters(x.device, tiles) if splits > 1 else out
    _gemv_kernel[(tiles, splits)](
        x, weight, bias if bias is not None else out, residual if residual is not None else out, out, part, counters,
        m, n, k, k_per_split, x.stride(0), weight.stride(0), residual.stride(0) if residual is not None else 0,
        out.stride(0),
        M_PAD=MAX_ROWS, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, NUM_SPLITS=splits, HAS_BIAS=bias is not None,
        EVEN_K=k % cfg.block_k == 0, PRECISION="ieee" if x.dtype == torch.float32 else None,
        UPCAST=interpreting(), SWIGLU=swiglu, RESIDUAL=residual is not None, PDL=pdl,
        PREFETCH_LINES=prefetch_lines, LINE=line,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch_options(pdl))
    return out


def split_layout(cfg: GemvConfig, k: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """What a launch at ``cfg`` derives from K: the K elements per split (whole ``BLOCK_K`` chunks), the L2 lines
    per W row each program prefetches under ``pdl`` (a power of two for ``tl.arange``, within ``PREFETCH_BYTES``
    and the split's K range) and the elements per line."""
    k_per_split = triton.cdiv(triton.cdiv(k, cfg.block_k), cfg.num_splits) * cfg.block_k
    line = line_elems(dtype)
    lines = max(1, min(PREFETCH_BYTES // (cfg.block_n * LINE_BYTES), triton.cdiv(k_per_split, line)))
    return k_per_split, 1 << (lines.bit_length() - 1), line


def check_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """Shapes, dtypes, strides and devices of a ``gemv`` call; ValueError naming the bad tensor."""
    if x.dim() != 2 or x.dtype not in FLOAT_DTYPES or x.stride(-1) != 1 or x.shape[0] > MAX_ROWS:
        raise ValueError(f"x must be [M <= {MAX_ROWS}, K] of {FLOAT_DTYPES} with a contiguous last dim, "
                         f"got {x.dtype} {tuple(x.shape)} with strides {x.stride()}")
    k = x.shape[1]
    if weight.dim() != 2 or weight.shape[1] != k or weight.stride(-1) != 1:
        raise ValueError(f"weight must be [N, K={k}] with a contiguous last dim, "
                         f"got {tuple(weight.shape)} with strides {weight.stride()}")
    tensors = {"weight": weight} | ({"bias": bias} if bias is not None else {})
    for name, t in tensors.items():
        if t.dtype != x.dtype or t.device != x.device:
            raise ValueError(f"{name} must be {x.dtype} on {x.device} like x, got {t.dtype} on {t.device}")
    if bias is not None and (bias.shape != (weight.shape[0],) or bias.stride(0) != 1):
        raise ValueError(f"bias must be a contiguous [N={weight.shape[0]}], got {tuple(bias.shape)} "
                         f"with strides {bias.stride()}")


def _check_config(cfg: GemvConfig) -> None:
    for name in ("block_n", "block_k"):
        value = getattr(cfg, name)
        if value < 16 or value & (value - 1):
            raise ValueError(f"gemv {name} must be a power of two >= 16 (tl.dot minimum), got {value}")
    if cfg.num_splits < 1:
        raise ValueError(f"gemv num_splits must be >= 1, got {cfg.num_splits}")
