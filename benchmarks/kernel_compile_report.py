"""Compile the decode step's Triton kernels for sm_90 on any machine (no GPU needed) and report what ptxas made.

For each kernel at the Qwen3-1.7B shape (16 query / 8 KV heads, head dim 128, bf16, block 16):
registers, spill bytes, shared memory, K/V shared-memory buffers chosen by Triton's pipeliner (from
the TTGIR), and SASS facts: 16-byte global loads, async copies (LDGSTS), matrix instructions; for the
kernels of the decode step's PDL chain (``kernels.pdl``), a variant compiled with ``PDL`` and whether its
PTX has the wait (``griddepcontrol.wait``) and, for the GEMV and the decode kernel, the L2 prefetch.

    python benchmarks/kernel_compile_report.py [--tile 32 64 128] [--stages 2 3 4 5] [--warps 4 8]

Uses the ptxas / cuobjdump that ship inside the Triton wheel. Launch parameters default to the
launchers' own choices on an H200 (``decode_config`` / ``gemv_config`` with its 132 multiprocessors, whatever
this machine is: on a CPU they would pick other shapes, and a spill at the GPU's shape would go unseen — the GEMV's
MLP tail spilled ~15 KB a thread at the H200's 16 x 512 tile while the CPU's 64 x 128 compiled clean), the
decode kernel at batch 1 (8K context, the graphs' split count) and at batch 16, every GEMV at its own split count.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from sliderl.kernels.cache_write import _write_kv_kernel  # noqa: E402
from sliderl.kernels.decode import _decode_kernel, _page_mass_kernel, decode_config  # noqa: E402
from sliderl.kernels.gemv import MAX_ROWS, _gemv_kernel, gemv_config, split_layout  # noqa: E402
from sliderl.kernels.norm_rope import _qk_norm_rope_kernel, _rms_norm_kernel, _silu_mul_kernel  # noqa: E402
from sliderl.kernels.prefill import _prefill_kernel, prefill_config  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
H200_SMS = 132  # the launchers size their grids by the device's multiprocessors: the H200's here
BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
ALIGNED = [["tt.divisibility", 16]]
STRIDES = ("stride_qn", "stride_qh", "stride_kb", "stride_ks", "stride_kh", "stride_on", "stride_oh",
           "stride_bt", "stride_bi", "stride_kn", "stride_vn", "stride_vh", "stride_cb", "stride_cs", "stride_ch",
           # the GEMV's: Triton specialises an integer argument that is a multiple of 16 as one, and at the
           # Qwen3-1.7B shapes all of these are
           "stride_xm", "stride_wn", "stride_rm", "stride_om", "n", "k", "k_per_split")


def signature(fn, ptr: str, consts: dict) -> tuple[dict, dict]:
    """Triton signature and 16-byte-alignment attributes for every argument of ``fn``."""
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = {"part_acc_ptr": "*fp32", "part_max_ptr": "*fp32", "part_sum_ptr": "*fp32",
                         "norm_max_ptr": "*fp32", "norm_sum_ptr": "*fp32", "seg_lse_ptr": "*fp32", "mass_ptr": "*fp32",
                         "slot_mapping_ptr": "*i64", "counter_ptr": "*i32", "part_ptr": "*fp32",
                         }.get(name, "*i32" if name in INT_PTRS else ptr)
            attrs[(i,)] = ALIGNED
        elif name in ("scale_log2", "eps"):
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
            if name in STRIDES:
                attrs[(i,)] = ALIGNED
    return sig, attrs


INT_PTRS = {"death_ptr", "block_tables_ptr", "block_index_ptr", "num_live_ptr", "query_start_ptr", "query_pos_ptr",
            "slot_death_ptr", "kill_ptr"}


def compile_and_report(tag: str, fn, consts: dict, warps: int, stages: int, ptr: str = "*bf16") -> dict:
    sig, attrs = signature(fn, ptr, consts)
    kernel = triton.compile(ASTSource(fn, sig, consts, attrs), target=TARGET,
                            options={"num_warps": warps, "num_stages": stages})
    with tempfile.TemporaryDirectory() as tmp:
        ptx, cubin = Path(tmp, "k.ptx"), Path(tmp, "k.cubin")
        ptx.write_text(kernel.asm["ptx"])
        cubin.write_bytes(kernel.asm["cubin"])
        ptxas = subprocess.run([BIN / "ptxas-blackwell", "-arch=sm_90a", "-v", ptx, "-o", os.devnull],
                               capture_output=True, text=True).stderr
        sass = subprocess.run([BIN / "cuobjdump", "-sass", cubin], capture_output=True, text=True).stdout
    buffers = re.findall(r"%([kv])_\d+ = ttg.local_alloc : \(\) -> !ttg.memdesc<(\d+)x", kernel.asm["ttgir"])
    ptx_text = kernel.asm["ptx"]
    return {
        "kernel": tag, "warps": warps, "stages": stages,
        "wait": "griddepcontrol.wait" in ptx_text, "prefetch": "prefetch.global.L2" in ptx_text,
        "regs": _first(r"Used (\d+) registers", ptxas), "spill": _first(r"(\d+) bytes spill stores", ptxas),
        "smem": kernel.metadata.shared, "kv_buffers": buffers[0][1] if buffers else "-",
        "ld128": "LDG.E.128" in sass or "LDGSTS.E.BYPASS.128" in sass, "ldgsts": "LDGSTS" in sass,
        "mma": "HGMMA" if "HGMMA" in sass else ("HMMA" if "HMMA" in sass else "-"),
    }


def _first(pattern: str, text: str) -> str:
    m = re.search(pattern, text)
    return m.group(1) if m else "?"


def h200_shapes() -> None:
    """Make ``decode_config`` and ``gemv_config`` choose as on an H200 (132 multiprocessors) on any machine."""
    import sliderl.kernels.decode as decode_module
    import sliderl.kernels.gemv as gemv_module
    decode_module.num_sms = gemv_module.num_sms = lambda device: H200_SMS


def decode_rows(tiles, warps, stages) -> list[dict]:
    """The decode kernel at batch 1 (8K context under prefix_sliding:4096: 263 live blocks, the width rounded to
    512 as ``DecodeGraphs`` rounds it) and batch 16, each plain, with h2o's mass, and in the PDL chain; or, with
    ``--tile/--warps/--stages``, those shapes at 2 splits."""
    if tiles or warps or stages:
        base = decode_config(1, 8, 16, 512, 128, torch.bfloat16, torch.device("cuda"))
        shapes = [(f"decode tile {t}", type(base)(t, 2, w, s)) for t in tiles or [base.tile_n]
                  for w in warps or [base.num_warps] for s in stages or [base.num_stages]]
    else:
        shapes = [(f"decode b{n}", decode_config(n, 8, 16, 512, 128, torch.bfloat16, torch.device("cuda")))
                  for n in (1, 16)]
    rows = []
    for name, cfg in shapes:
        t = cfg.tile_n
        # every policy's decode; h2o's, which also writes per-segment mass; the PDL chain's; registers' (the
        # pending kill of a step queued before its register token was read back)
        for mass, pdl, kill in ((False, False, False), (True, False, False), (False, True, False), (True, True, False),
                                (False, False, True), (False, True, True)):
            consts = dict(GROUP=2, GROUP_PAD=16, HEAD_DIM=128, DIM_PAD=128, BLOCK_SIZE=16, TILE_N=t,
                          NUM_SPLITS=cfg.num_splits, PRECISION=None, UPCAST=False, OUTPUT_MASS=mass, SEG=min(t, 16),
                          SEGS_PER_TILE=t // min(t, 16), PDL=pdl, LINE=64, LINES_PAD=2, KILL=kill)
            tag = name + (" h2o" if mass else "") + (" registers" if kill else "") + (" pdl" if pdl else "")
            rows.append(compile_and_report(tag, _decode_kernel, consts, cfg.num_warps, cfg.num_stages))
    mass = dict(GROUP=2, GROUP_PAD=16, BLOCK_SIZE=16, SEG=16, CHUNK=128)
    rows.append(compile_and_report("h2o page mass", _page_mass_kernel, mass, 4, 1))
    return rows


def other_rows() -> list[dict]:
    cfg = prefill_config(2048, 2, 128, torch.bfloat16)
    prefill = dict(GROUP=2, GROUP_PAD=2, BLOCK_Q=cfg.block_q, HEAD_DIM=128, DIM_PAD=128, BLOCK_SIZE=16,
                   TILE_N=cfg.tile_n, PRECISION=None, UPCAST=False)
    rows = [compile_and_report(f"prefill {cfg.block_q}x2 rows, tile {cfg.tile_n}", _prefill_kernel, prefill,
                               cfg.num_warps, cfg.num_stages)]
    for pdl in (False, True):
        tail = " pdl" if pdl else ""
        write = dict(NUM_HEADS=8, HEADS_PAD=8, HEAD_DIM=128, DIM_PAD=128, BLOCK_SIZE=16, WRITE_DEATH=True, PDL=pdl)
        rows.append(compile_and_report("write_kv" + tail, _write_kv_kernel, write, 4, 1))
        norm = dict(BLOCK=2048, ADD_RESIDUAL=True, PDL=pdl)
        rows.append(compile_and_report("rms_norm" + tail, _rms_norm_kernel, norm, 8, 1))
        rope = dict(Q_HEADS=16, Q_HEADS_PAD=16, KV_HEADS=8, KV_HEADS_PAD=8, HALF=64, HALF_PAD=64, NORM=True, PDL=pdl)
        rows.append(compile_and_report("qk_norm_rope" + tail, _qk_norm_rope_kernel, rope, 4, 1))
        rows.append(compile_and_report("silu_mul" + tail, _silu_mul_kernel, dict(BLOCK=1024, PDL=pdl), 4, 1))
    # the decoder's linears at batch <= 16 (kernels.gemv at Qwen3-1.7B's shapes, each at the launcher's choices);
    # down_proj as the MLP's fused tail
    for name, n, k, tail in (("gemv qkv", 4096, 2048, False), ("gemv gate_up", 12288, 2048, False),
                             ("gemv o_proj", 2048, 2048, False), ("gemv down+swiglu+res", 2048, 6144, True),
                             ("gemv lm_head", 151936, 2048, False)):
        cfg = gemv_config(n, k, torch.bfloat16, torch.device("cuda"), swiglu=tail)
        _, prefetch_lines, line = split_layout(cfg, k, torch.bfloat16)  # as gemv() launches it
        for pdl in (False, True):
            consts = dict(M_PAD=MAX_ROWS, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, NUM_SPLITS=cfg.num_splits,
                          HAS_BIAS=False, EVEN_K=k % cfg.block_k == 0, PRECISION=None, UPCAST=False, SWIGLU=tail,
                          RESIDUAL=tail, PDL=pdl, PREFETCH_LINES=prefetch_lines, LINE=line)
            rows.append(compile_and_report(name + (" pdl" if pdl else ""), _gemv_kernel, consts, cfg.num_warps,
                                           cfg.num_stages))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tile", type=int, nargs="*", help="decode tile sizes (default: decode_config's)")
    p.add_argument("--warps", type=int, nargs="*")
    p.add_argument("--stages", type=int, nargs="*")
    args = p.parse_args()
    h200_shapes()
    rows = decode_rows(args.tile, args.warps, args.stages) + other_rows()
    print(f"{'kernel':<28} {'warps':>5} {'stages':>6} {'regs':>5} {'spill':>5} {'smem':>7} {'K/V bufs':>8} "
          f"{'16B ld':>6} {'LDGSTS':>6} {'mma':>5} {'wait':>5} {'prefetch':>8}")
    for r in rows:
        print(f"{r['kernel']:<28} {r['warps']:>5} {r['stages']:>6} {r['regs']:>5} {r['spill']:>5} {r['smem']:>7} "
              f"{r['kv_buffers']:>8} {str(r['ld128']):>6} {str(r['ldgsts']):>6} {r['mma']:>5} {str(r['wait']):>5} "
              f"{str(r['prefetch']):>8}")


if __name__ == "__main__":
    main()
