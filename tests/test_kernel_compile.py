"""Every Triton kernel compiles for the H200 (sm_90) on this CPU machine, without spilling registers.

The interpreter (``TRITON_INTERPRET=1``, where the kernel tests run) executes a kernel's Python with its dots
upcast to float32, so it accepts code that Triton's compiler refuses on the GPU. ``benchmarks/
kernel_compile_report.py`` compiles each kernel for sm_90 with the ptxas that ships in the Triton wheel, at the
Qwen3-1.7B shape and the launchers' own choices on an H200 (its 132 multiprocessors, not this machine's), h2o's
mass-writing decode and its page-mass kernel included."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(300)
def test_every_kernel_compiles_for_sm90_without_spills():
    # Catches a kernel that only the interpreter accepts (planted: the decode kernel's p @ v with p left in
    # float32 against bf16 values — every interpreter kernel test passes, this compile fails), a kernel missing
    # from the report (the report had fallen behind the decode kernel: OUTPUT_MASS and SEG compiled as runtime
    # arguments), and register spills at the H200's launch shapes (spill column > 0): planted, the GEMV's MLP tail
    # back at 16 KB of W a stage (SWIGLU_W_TILE_BYTES = 16384, as at 4ae9f64, where the engine's GEMV path decoded
    # 20 tok/s) spills ~15 KB a thread and fails here; the report had compiled it at a CPU's shapes, which do not.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "kernel_compile_report.py")], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, out.stderr[-4000:]
    lines = out.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("kernel"))
    rows = {}
    for line in lines[header + 1:]:
        name, cells = line[:28].strip(), line[28:].split()
        rows[name] = dict(zip(["warps", "stages", "regs", "spill", "smem", "bufs", "ld128", "ldgsts", "mma", "wait",
                               "prefetch"], cells))
    assert {"decode b1", "decode b1 h2o", "decode b1 registers", "decode b16", "decode b16 h2o", "decode b16 registers",
            "h2o page mass", "write_kv", "gemv lm_head"} <= set(rows), rows
    # The PDL chain (kernels.pdl): every kernel of the decode step compiled with PDL waits on griddepcontrol, the GEMV
    # and the decode kernel also prefetch into L2, and nothing compiled without it waits. Catches the wait dropped
    # from a kernel (planted: the GEMV's wait_then_release call removed), the prefetch compiled away, or the wait
    # leaking into the plain kernels (planted: wait_then_release ignoring PDL), and the GEMV's fused MLP tail or
    # the PDL variants failing to compile for sm_90 at all.
    chained = {"decode b1 pdl", "decode b1 h2o pdl", "decode b1 registers pdl", "decode b16 pdl", "decode b16 h2o pdl",
               "decode b16 registers pdl", "write_kv pdl",
               "rms_norm pdl", "qk_norm_rope pdl", "silu_mul pdl", "gemv qkv pdl", "gemv gate_up pdl", "gemv o_proj pdl",
               "gemv down+swiglu+res pdl", "gemv lm_head pdl"}
    assert chained <= set(rows), sorted(set(rows))
    for name, row in rows.items():
        assert row["wait"] == str(name in chained), (name, row)
        assert row["prefetch"] == str(name in chained and (name.startswith(("gemv", "decode")))), (name, row)
    assert any(name.startswith("prefill") for name in rows), rows
    for name, row in rows.items():
        assert row["spill"] == "0", (name, row)
        assert int(row["regs"]) <= 255, (name, row)
