"""FlexAttention's forward and backward at a learner's shape, under its default kernel options and under others.

    python benchmarks/flex_attention.py --tokens 32768 --prompt 128 --window 4096 --heads 28 --kv-heads 4 \\
        --configs default bwd_num_stages=2 --out DIR                      # GPU: the 7B step's attention
    python benchmarks/flex_attention.py --cpu-smoke --out DIR           # CPU: the script runs (eager, forward only)

Issue 38, item 3: in the 7B whole-trace learner step (1x H100, a8d8fe3) FlexAttention's backward took 16% of the
step at 183 TFLOP/s, half its forward's rate. This times one layer's attention the way the learner runs it: one
whole ``prefix_sliding:W`` trace of ``--tokens`` tokens (``--prompt`` of them prompt) packed as the learner packs
it (``trainer.logprobs.pack_windows``), its block mask and ``trainer.attention.FlexPolicyAttention``, random bf16
q [T, H, D] and k/v [T, H_kv, D]. Per config: compile (dynamo reset first), one warm-up forward + backward, then
``--repeats`` timed forwards and ``--repeats`` timed forward + backward passes (CUDA events, median). TFLOP/s
count the visible (query, key) pairs: forward 4·H·D·pairs, backward 8·H·D·pairs, the backward's time being the
forward + backward's minus the forward's. Each config's output and gradients are compared with the first
config's (max abs difference): a faster config that computes something else shows here.

A config is ``default`` (FlexAttention's own choice for the card) or ``KEY=VALUE[,KEY=VALUE...]`` of
``flex_attention``'s kernel_options: ``BLOCK_M``/``BLOCK_N`` (forward tiles), ``BLOCK_M1``, ``BLOCK_N1``,
``BLOCK_M2``, ``BLOCK_N2`` (backward tiles), ``num_stages``, ``num_warps``, each with a ``fwd_`` or ``bwd_``
prefix for one pass only, ``USE_TMA``. A config the compiler rejects (too much shared memory) gets its error as
its row. Rows: ``OUT/rows.jsonl`` and a table on stdout.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def parse_config(spec: str) -> dict | None:
    """``default`` -> None; ``A=1,B=2`` -> {"A": 1, "B": 2} (integers; ``true``/``false`` as booleans).
    ValueError names the bad part."""
    if spec == "default":
        return None
    out = {}
    for part in spec.split(","):
        key, sep, value = part.partition("=")
        if not sep or not key:
            raise ValueError(f"config {spec!r}: {part!r} is not KEY=VALUE (e.g. bwd_num_stages=2), nor 'default'")
        low = value.lower()
        if low in ("true", "false"):
            out[key] = low == "true"
        else:
            try:
                out[key] = int(value)
            except ValueError:
                raise ValueError(f"config {spec!r}: {key}={value!r} is not an integer nor true/false") from None
    return out


def visibility_of(tokens: int, prompt: int, window: int):
    """The packed stream the learner trains one whole ``prefix_sliding:window`` trace as, and its visible pairs."""
    from benchmarks.learner_gpu import learner_counts, make_traces
    from sliderl.core.kv_policy import KVPolicy
    from sliderl.trainer.logprobs import pack_windows, window_input
    from sliderl.trainer.windows import training_windows

    trace = make_traces(prompt, tokens - prompt, window, 256)[0]
    policy = KVPolicy.parse(trace.kv_policy)
    items = [window_input(trace.prompt_token_ids, trace.completion_token_ids, policy, trace.temperature, w)
             for w in training_windows("full", prompt, tokens - prompt, policy.window, 4)]
    return pack_windows(items).visibility, learner_counts([trace], "full", 4)["visible"]


def time_config(args: argparse.Namespace, visibility, options: dict | None,
                reference: list | None) -> tuple[dict, list | None]:
    """The config's row, and its output and gradients (None when it failed); ``reference``: the first ok
    config's, which the row's max_abs_diff is taken against."""
    import torch

    from sliderl.trainer.attention import FlexPolicyAttention

    cuda = not args.cpu_smoke
    device = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32
    torch._dynamo.reset()  # each config its own compiled graph (and no recompile limit across the configs)
    gen = torch.Generator(device=device).manual_seed(0)
    n = len(visibility)
    q, k, v = (torch.randn(n, h, args.head_dim, device=device, dtype=dtype, generator=gen).requires_grad_(cuda)
               for h in (args.heads, args.kv_heads, args.kv_heads))
    grad = torch.randn(n, args.heads, args.head_dim, device=device, dtype=dtype, generator=gen)
    attn = FlexPolicyAttention(visibility.to(device), compiled=cuda, kernel_options=options)

    def forward():
        return attn(0, q, k, v)

    def both():
        out = forward()
        return out, (torch.autograd.grad(out, (q, k, v), grad) if cuda else ())

    def timed(fn) -> float:
        if not cuda:
            import time
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e3
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)

    try:
        out, grads = both()  # compiles forward and backward
    except Exception as e:  # noqa: BLE001  (a config the compiler rejects is a row, not the end of the sweep)
        return {"status": f"failed: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"}, None
    fwd_ms = statistics.median(timed(forward) for _ in range(args.repeats))
    both_ms = statistics.median(timed(both) for _ in range(args.repeats)) if cuda else None  # CPU: no backward
    row = {"status": "ok", "forward_ms": fwd_ms, "forward_backward_ms": both_ms}
    tensors = [t.detach() for t in (out, *grads)]
    if reference is not None:
        row["max_abs_diff"] = max(float((a.float() - b.float()).abs().max())
                                  for a, b in zip(tensors, reference, strict=True))
    return row, tensors


def rates(row: dict, pairs: int, heads: int, head_dim: int) -> dict:
    """Forward and backward TFLOP/s: 4·H·D·pairs and 8·H·D·pairs over their milliseconds (no backward: None)."""
    both = row["forward_backward_ms"]
    bwd_ms = both - row["forward_ms"] if both is not None else None
    return {"backward_ms": bwd_ms, "forward_tflops": 4 * heads * head_dim * pairs / row["forward_ms"] / 1e9,
            "backward_tflops": 8 * heads * head_dim * pairs / bwd_ms / 1e9 if bwd_ms and bwd_ms > 0 else None}


def table(rows: list[dict]) -> str:
    lines = [f"{'config':<48} {'status':>6} {'fwd ms':>8} {'bwd ms':>8} {'fwd TF/s':>9} {'bwd TF/s':>9} "
             f"{'vs first':>9} {'max |diff|':>10}"]
    base = next((r for r in rows if r["status"] == "ok"), None)
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"{r['config'][:48]:<48} {r['status'][:120]}")
            continue
        key = "forward_backward_ms" if r["forward_backward_ms"] is not None else "forward_ms"
        speed = f"{base[key] / r[key]:8.2f}x"
        bwd_ms = f"{r['backward_ms']:8.2f}" if r["backward_ms"] is not None else f"{'-':>8}"
        bwd = f"{r['backward_tflops']:9.0f}" if r["backward_tflops"] else f"{'-':>9}"
        diff = f"{r['max_abs_diff']:10.2e}" if "max_abs_diff" in r else f"{'(ref)':>10}"
        lines.append(f"{r['config'][:48]:<48} {'ok':>6} {r['forward_ms']:8.2f} {bwd_ms} "
                     f"{r['forward_tflops']:9.2f} {bwd} {speed} {diff}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=32768, help="T: the trace's tokens, prompt included")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--window", type=int, default=4096, help="W of the trace's prefix_sliding policy")
    p.add_argument("--heads", type=int, default=28, help="query heads (28: the 7B; Qwen3-1.7B: 16)")
    p.add_argument("--kv-heads", type=int, default=4, help="key/value heads (4: the 7B; Qwen3-1.7B: 8)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--configs", nargs="+", default=["default"], help="'default' or KEY=VALUE[,...] (docstring)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=Path, default=Path("runs/flex_attention"))
    p.add_argument("--cpu-smoke", action="store_true", help="CPU, eager FlexAttention, forward only, a small shape")
    args = p.parse_args(argv)
    if args.cpu_smoke:
        args.tokens, args.prompt, args.window, args.heads, args.kv_heads, args.head_dim = 512, 16, 128, 4, 2, 16
        args.repeats = 1
    for name, value in (("tokens", args.tokens), ("window", args.window), ("heads", args.heads),
                        ("kv-heads", args.kv_heads), ("head-dim", args.head_dim), ("repeats", args.repeats)):
        if value < 1:
            p.error(f"--{name} {value}: must be at least 1")
    if not 0 < args.prompt < args.tokens:
        p.error(f"--prompt {args.prompt}: must be at least 1 and below --tokens ({args.tokens})")
    if args.heads % args.kv_heads:
        p.error(f"--heads {args.heads} is not a multiple of --kv-heads {args.kv_heads}")
    try:
        args.options = [parse_config(c) for c in args.configs]
    except ValueError as e:
        p.error(str(e))
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    visibility, pairs = visibility_of(args.tokens, args.prompt, args.window)
    print(f"T {args.tokens} (prompt {args.prompt}), prefix_sliding:{args.window}, H {args.heads}/{args.kv_heads}, "
          f"D {args.head_dim}: {pairs:,} visible pairs ({pairs / args.tokens:.0f} keys a query)", flush=True)
    rows, reference = [], None
    for spec, options in zip(args.configs, args.options, strict=True):
        timed, tensors = time_config(args, visibility, options, reference)
        row = {"config": spec, "kernel_options": options, "tokens": args.tokens, "prompt": args.prompt,
               "window": args.window, "heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim,
               "visible_pairs": pairs, **timed}
        if row["status"] == "ok":
            reference = reference if reference is not None else tensors
            row.update(rates(row, pairs, args.heads, args.head_dim))
        rows.append(row)
        with (args.out / "rows.jsonl").open("a") as f:  # row by row: a sweep cut by its time limit keeps its rows
            f.write(json.dumps(row) + "\n")
        print(f"{spec}: {row['status']}", flush=True)
    print(table(rows), flush=True)


if __name__ == "__main__":
    main()
