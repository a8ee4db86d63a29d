"""Fused Gumbel-max sampling: ``rollout.sampling.sample`` without top-k/top-p, one pass over the logits.

The torch sampler builds the counter-based noise as a chain of element-wise int64 ops over ``[B, V]``
(about forty passes over 8 bytes per element: at 256 rows of a 152K vocabulary several milliseconds
per decode step, a fifth of the step). Here one program per row streams its logits once, computes
the same 32-bit hash with uint32 arithmetic (wrapping products are exactly the torch code's
products mod 2**32), the same uniform and Gumbel noise, and keeps in registers: the Gumbel-max
winner, the greedy winner (rows with T == 0) and an online log-sum-exp of ``logits / T`` for the
logprob. Same tokens as the torch path except where float rounding breaks an exact near-tie; same
logprobs to float32 rounding. See ``rollout.sampling`` for the noise and the logprob convention.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sliderl.kernels.launch_checks import interpreting

BLOCK_V = 2048


@triton.jit
def _mix32(x):
    """lowbias32 on uint32 (products wrap mod 2**32)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D).to(tl.uint32)  # the low 32 bits of the product, whatever width it was taken in
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B).to(tl.uint32)
    return x ^ (x >> 16)


@triton.jit
def _sample_kernel(logits_ptr, stride_row, temperature_ptr, seed_ptr, step_ptr, token_ptr, logprob_ptr, V,
                   BLOCK: tl.constexpr):
    row = tl.program_id(0)
    t = tl.load(temperature_ptr + row)
    greedy = t <= 0
    t = tl.where(greedy, 1.0, t)
    seed = tl.load(seed_ptr + row)  # int64; its two 32-bit halves (two's complement), as noise_keys
    seed_lo = (seed & 0xFFFFFFFF).to(tl.uint32)
    seed_hi = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    step_lo = (tl.load(step_ptr + row) & 0xFFFFFFFF).to(tl.uint32)
    key_a = _mix32(_mix32(_mix32(seed_hi ^ 0x2545F491) ^ seed_lo) ^ step_lo)
    key_b = _mix32(key_a ^ 0x9E3779B9)
    offs = tl.arange(0, BLOCK)
    best_score = -float("inf")  # Gumbel-max: max of scaled + g, its index and its scaled value
    best_index = 0
    best_scaled = -float("inf")
    top = -float("inf")  # greedy: max of scaled and its index
    top_index = 0
    run_max = -float("inf")  # online log-sum-exp of scaled
    run_sum = 0.0
    for start in range(0, V, BLOCK):
        idx = start + offs
        valid = idx < V
        x = tl.load(logits_ptr + row * stride_row + idx, mask=valid, other=0.0).to(tl.float32)
        scaled = tl.where(valid, tl.math.div_rn(x, t), -float("inf"))
        h = _mix32(_mix32(idx.to(tl.uint32) ^ key_a) ^ key_b)
        u = ((h >> 9) * 2 + 1).to(tl.float32) * 5.9604644775390625e-08  # 2**-24: in (0, 1), exact
        score = tl.where(valid, scaled - tl.log(-tl.log(u)), -float("inf"))
        m = tl.max(score, 0)
        i = tl.argmax(score, 0)
        if m > best_score:  # strictly: the first index wins a tie, as torch.argmax
            best_score = m
            best_index = start + i
            best_scaled = tl.max(tl.where(offs == i, scaled, -float("inf")), 0)
        ms = tl.max(scaled, 0)
        if ms > top:
            top = ms
            top_index = start + tl.argmax(scaled, 0)
        new_max = tl.maximum(run_max, ms)
        run_sum = run_sum * tl.exp(run_max - new_max) + tl.sum(tl.exp(scaled - new_max), 0)
        run_max = new_max
    lse = run_max + tl.log(run_sum)
    token = tl.where(greedy, top_index, best_index)
    picked = tl.where(greedy, top, best_scaled)
    tl.store(token_ptr + row, token.to(tl.int64))
    tl.store(logprob_ptr + row, picked - lse)


def fused_sample(logits: torch.Tensor, temperature: torch.Tensor, seed: torch.Tensor,
                 step: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens ``[B]`` int64 and logprobs ``[B]`` float32 for ``logits [B, V]`` (rows contiguous).

    ``temperature [B]`` float32 (0 = greedy); ``seed``, ``step`` ``[B]`` int64 as ``rollout.sampling.sample``
    takes them (the hash keys are computed in the kernel: on the host side they were two dozen tiny
    launches). No top-k/top-p: the caller keeps those rows on the torch path.
    """
    b, v = logits.shape
    if logits.stride(1) != 1:
        raise ValueError(f"logits rows must be contiguous, got strides {logits.stride()}")
    for name, t in (("temperature", temperature), ("seed", seed), ("step", step)):
        if tuple(t.shape) != (b,) or t.device != logits.device:
            raise ValueError(f"{name} must be [B] = ({b},) on {logits.device}, got {tuple(t.shape)} on {t.device}")
    tokens = torch.empty(b, dtype=torch.int64, device=logits.device)
    logprobs = torch.empty(b, dtype=torch.float32, device=logits.device)
    if b:
        block = 256 if interpreting() else BLOCK_V
        _sample_kernel[(b,)](logits, logits.stride(0), temperature.to(torch.float32).contiguous(),
                             seed.to(torch.int64).contiguous(), step.to(torch.int64).contiguous(), tokens, logprobs,
                             v, BLOCK=block,
                             num_warps=8)
    return tokens, logprobs
