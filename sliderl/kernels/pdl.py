"""Programmatic dependent launch (PDL) for the decode chain, and L2 prefetch of what a kernel does not wait for.

At batch 1 a decode step is ~300 short kernels (a layer: norm, q/k/v, q/k-norm + RoPE, cache write, attention,
o, norm, gate/up, down), each reading a few MB. Launched one after the other, each pays its ramp-up (first
loads in flight) and its tail (the last programs draining) with the memory system half idle. With PDL (Hopper
and later) kernel N+1 is launched while kernel N still runs. Every kernel of the chain is written as:

1. work that needs nothing an earlier kernel of the step writes — the L2 prefetch of its weights (the GEMVs)
   or of its live K/V lines (attention), constant loads such as a norm's weight;
2. ``gdc_wait``: blocks until the previous kernel has completed and its writes are visible;
3. ``gdc_launch_dependents``: lets the next kernel launch (after the wait, so at most two kernels of the
   chain are resident: the one computing and the one prefetching);
4. everything else. No store comes before the wait: the previous kernel may still read what this one writes.

Why this is safe across more than one kernel: kernel N+1 completes only after its wait, which returns only
after kernel N completed, so a kernel that waits sees every earlier kernel's writes. An L2 prefetch moves no
data into registers or L1, and L2 is where the GPU's writes meet, so prefetching a line that an earlier
kernel is still writing (the newest token's K/V) is only a wasted fetch, never a stale read.

Launchers pass ``launch_pdl=True`` (the CUDA launch attribute) only with ``pdl``; a graph captured from such
launches keeps programmatic edges. Everything here compiles away unless the kernel's ``PDL`` flag is set,
which the launchers never set under ``TRITON_INTERPRET=1`` (the interpreter has neither the wait nor inline
PTX), so the CPU tests run the same kernels without it.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from sliderl.kernels.launch_checks import interpreting

LINE_BYTES = 128  # an L2 cache line: one prefetch each


@triton.jit
def prefetch_l2(ptrs):
    """Ask L2 for the lines at ``ptrs`` (any shape of valid addresses); returns nothing anyone reads."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def wait_then_release(PDL: tl.constexpr):
    """Steps 2 and 3 of the module docstring; nothing without ``PDL``."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@functools.lru_cache(maxsize=None)
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)  # once per device: launchers check on every launch


def pdl_supported(device: torch.device) -> bool:
    """PDL needs a CUDA device of compute capability 9.0 (Hopper) or later, and compiled kernels."""
    return device.type == "cuda" and not interpreting() and _capability(device)[0] >= 9


def launch_options(pdl: bool) -> dict:
    """Extra launch keywords: the PDL attribute when asked for (``check_pdl`` first)."""
    return {"launch_pdl": True} if pdl else {}


def check_pdl(pdl: bool, device: torch.device) -> bool:
    """``pdl`` for a launch on ``device``; ValueError when asked for where it cannot run."""
    if pdl and not pdl_supported(device):
        what = "the Triton interpreter" if interpreting() else str(device)
        if device.type == "cuda" and not interpreting():
            what += f" (compute capability {'.'.join(map(str, _capability(device)))})"
        raise ValueError(f"pdl needs a CUDA device of compute capability 9.0 or later (Hopper), got {what}")
    return pdl


def line_elems(dtype: torch.dtype) -> int:
    """Elements of ``dtype`` per L2 line."""
    return LINE_BYTES // torch.empty((), dtype=dtype).element_size()

