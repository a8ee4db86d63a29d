"""Decode throughput and per-token latency over a long generation: the restart baselines against Prefix Sliding.

Issue 39's H200 measurement: ``last_k:4096:256``, ``summary:4096:256`` and ``prefix_sliding:4096`` on the Qwen3-1.7B
config (random bf16 weights, the byte tokenizer with ``<tool_call>``/``</tool_call>``), each generating ``--tokens``
tokens (``ignore_eos``) after a 100-token prompt, at batch 1 and batch 256 (``--batches``), so that the restarts'
re-prefill is measured, not estimated. Every request is real generation through ``LLM.generate``: CUDA graphs for
decode, chunked prefill for the re-encoded tails (batched with other sequences' decodes), overlap on.

Summaries are scripted by the engine itself: summary forcing opens the call when S tokens are left and forces its
closing when the call reaches S tokens, so each call is S tokens of the model's own (random) text between the
paper's JSON opening and closing; a random model rarely opens or closes the call itself (it may: the count of
calls the model opened is reported).

Per request the engine records when each token was taken (``RequestOutput.token_seconds``); the per-token latency
at generated index i is the gap to token i - 1. Reported per policy and batch: wall seconds, tokens per second
(all requests), the mean / p50 / p99 / max per-token latency, the restarts and tokens re-encoded per request, the
batch the KV pool held at once, and the latency profile over the generation (mean gap per ``--bin`` tokens: the
paper's Figure 10 sawtooth), in ``--out``/restart_gpu.json, .md and, with matplotlib, sawtooth.png.

    python benchmarks/restart_gpu.py --batches 1 --tokens 32768 --out $OUT/restart-gpu          # ~4-5 min, H200
    python benchmarks/restart_gpu.py --batches 256 --tokens 8192 --policies last_k:4096:256 --out $OUT/rg-lk
    python benchmarks/restart_gpu.py --smoke --out /tmp/restart-gpu                              # CPU, tiny model
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from sliderl.core.restart import RESTART_TOKENS  # noqa: E402
from sliderl.rollout import LLM, SamplingParams  # noqa: E402
from sliderl.rollout.restart.records import RestartRequestOutput  # noqa: E402

PROMPT = 100
POLICIES = ["prefix_sliding:4096", "last_k:4096:256", "summary:4096:256"]


def build_model(root: Path, smoke: bool) -> Path:
    """The Qwen3-1.7B config (random bf16 weights) or, for ``smoke``, a tiny CPU model; both with the tool tokens."""
    if smoke:
        from sliderl.core.tiny import make_tiny_model
        return make_tiny_model(root / "tiny", "qwen3", extra_special_tokens=RESTART_TOKENS)
    from sliderl.core.tiny import make_qwen3_1p7b
    return make_qwen3_1p7b(root / "qwen3-1.7b", extra_special_tokens=RESTART_TOKENS)


def latency_profile(outputs, bin_tokens: int) -> list[float]:
    """Mean per-token latency (seconds) over every request, per ``bin_tokens`` generated tokens."""
    sums: dict[int, list[float]] = {}
    for out in outputs:
        times = out.token_seconds
        for i in range(1, len(times)):
            sums.setdefault(i // bin_tokens, []).append(times[i] - times[i - 1])
    return [statistics.fmean(sums[b]) for b in sorted(sums)]


def quantile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def bench(path: Path, spec: str, batch: int, tokens: int, args) -> dict:
    """One policy at one batch: every request generates ``tokens`` tokens; the measured row."""
    llm = LLM(str(path), kv=spec, device=args.device, dtype=args.dtype, max_num_seqs=batch, kv_cache_gb=args.kv_gb,
              max_num_batched_tokens=args.max_batched_tokens, max_model_len=PROMPT + tokens + 1)
    prompts = [[(7 * i + j) % 200 + 32 for j in range(PROMPT)] for i in range(batch)]
    params = SamplingParams(max_tokens=tokens, temperature=1.0, ignore_eos=True, seed=0)
    llm.generate([prompts[0]], SamplingParams(max_tokens=8, ignore_eos=True))  # warm-up: graphs, allocator
    concurrency = llm.max_concurrency(PROMPT, tokens)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    wall = time.perf_counter() - start
    gaps = [b - a for out in outputs for a, b in zip(out.token_seconds, out.token_seconds[1:])]
    restarts = [out.restarts if isinstance(out, RestartRequestOutput) else [] for out in outputs]
    row = {
        "policy": spec, "batch": batch, "tokens": tokens, "concurrency": concurrency, "wall_s": round(wall, 3),
        "tok_per_s": round(sum(len(o.token_ids) for o in outputs) / wall, 1),
        "latency_ms": {name: round(1e3 * value, 3) for name, value in (
            ("mean", statistics.fmean(gaps)), ("p50", quantile(gaps, 0.5)), ("p99", quantile(gaps, 0.99)),
            ("max", max(gaps)))},
        "restarts": statistics.fmean(len(r) for r in restarts),
        "reencoded_tokens": statistics.fmean(sum(len(x.context_tail) for x in r) for r in restarts),
        "model_opened_calls": sum(not x.forced for r in restarts for x in r),
        "kv_token_steps": statistics.fmean(o.kv.token_steps for o in outputs),
        "peak_visible_kv": max(o.kv.peak_visible_tokens for o in outputs),
        "profile_bin": args.bin, "profile_ms": [round(1e3 * v, 3) for v in latency_profile(outputs, args.bin)],
        "engine": {"steps": llm.stats.steps, "prefill_tokens": llm.stats.prefill_tokens,
                   "queued_ahead": llm.stats.queued_ahead},
    }
    llm.close()
    print(f"{spec:22s} batch {batch:3d} (at once {concurrency:3d})  {row['tok_per_s']:9.1f} tok/s  "
          f"latency mean {row['latency_ms']['mean']:.2f} ms p99 {row['latency_ms']['p99']:.2f} max "
          f"{row['latency_ms']['max']:.1f}  restarts {row['restarts']:.1f}  re-encoded {row['reencoded_tokens']:.0f}",
          flush=True)
    return row


def write_report(rows: list[dict], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "restart_gpu.json").write_text(json.dumps(rows, indent=1) + "\n")
    lines = ["| policy | batch | at once | tok/s | vs PS | latency mean / p50 / p99 / max ms | restarts | re-encoded |",
             "|---|---|---|---|---|---|---|---|"]
    ps = {r["batch"]: r["tok_per_s"] for r in rows if r["policy"].startswith("prefix_sliding")}
    for r in rows:
        lat = r["latency_ms"]
        ratio = f"{r['tok_per_s'] / ps[r['batch']]:.3f}" if r["batch"] in ps else "-"
        lines.append(f"| {r['policy']} | {r['batch']} | {r['concurrency']} | {r['tok_per_s']:.0f} | {ratio} | "
                     f"{lat['mean']:.2f} / {lat['p50']:.2f} / {lat['p99']:.2f} / {lat['max']:.1f} | "
                     f"{r['restarts']:.1f} | {r['reencoded_tokens']:.0f} |")
    (out / "restart_gpu.md").write_text("\n".join(lines) + "\n")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    batches = sorted({r["batch"] for r in rows})
    fig, axes = plt.subplots(1, len(batches), figsize=(6 * len(batches), 4), squeeze=False)
    for ax, batch in zip(axes[0], batches):
        for r in (r for r in rows if r["batch"] == batch):
            x = [(i + 0.5) * r["profile_bin"] for i in range(len(r["profile_ms"]))]
            ax.plot(x, r["profile_ms"], label=r["policy"], lw=1)
        ax.set(title=f"batch {batch}", xlabel="generated tokens", ylabel=f"mean per-token latency (ms, bins of "
                                                                         f"{rows[0]['profile_bin']})")
        ax.set_yscale("log")
        ax.legend()
    fig.tight_layout()
    fig.savefig(out / "sawtooth.png", dpi=120)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policies", nargs="+", default=POLICIES)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 256])
    parser.add_argument("--tokens", type=int, default=32768, help="tokens each request generates")
    parser.add_argument("--bin", type=int, default=64, help="generated tokens per point of the latency profile")
    parser.add_argument("--kv-gb", type=float, default=None,
                        help="KV pool in GiB; default 120 (the H200 rows), or what a smaller card holds")
    parser.add_argument("--max-batched-tokens", type=int, default=16384,
                        help="the longest prefill chunk per step (a restart's re-encoded tails go through it)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--model", type=Path, default=None, help="a model folder (default: build the 1.7B config)")
    parser.add_argument("--smoke", action="store_true", help="CPU, a tiny model, prefix_sliding:48 / last_k:48:8 / "
                                                             "summary:56:50 (the JSON call fits), 120 tokens, batch 2")
    parser.add_argument("--out", type=Path, default=Path("runs/restart-gpu"))
    args = parser.parse_args(argv)
    if args.smoke:
        args.device, args.dtype, args.kv_gb, args.bin = "cpu", "float32", 0.05, 16
        args.policies, args.batches, args.tokens = ["prefix_sliding:48", "last_k:48:8", "summary:56:50"], [2], 120
    if args.kv_gb is None:
        from benchmarks.engine_gpu import card_kv_gb

        args.kv_gb = card_kv_gb(120.0) if args.device.startswith("cuda") else 120.0
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model or build_model(Path(tmp), args.smoke)
        rows = []
        for batch in args.batches:
            for spec in args.policies:
                rows.append(bench(path, spec, batch, args.tokens, args))
                write_report(rows, args.out)  # after each row: a call cut at its time limit keeps what it measured
    return rows


if __name__ == "__main__":
    main()
