"""Learner throughput and MFU of one GRPO step on the Qwen3-1.7B config (random bf16 weights), with a peer row.

    python benchmarks/learner_gpu.py [--lengths 8192 32768] [--steps 2] [--budget-s 340] [--out DIR]
    python benchmarks/learner_gpu.py --tiny            # CPU, float32, tiny Qwen3: checks the script runs

The batch: one GRPO group of 8 synthetic ``prefix_sliding:W`` traces (prompt of P tokens, T generated
tokens, random ids, rewards 0..7 so every advantage is non-zero). Rows:

  sliderl  ``trainer.learner.Learner(device="cuda", dtype="bfloat16", micro_batch_tokens=32768)`` with
           compiled FlexAttention (``trainer.attention``), window_mode ``truncated`` (k=4: the last k·W
           generated tokens as context, loss on the last W) or ``full`` (the whole trace, loss on every
           token), gradient checkpointing on or off. A full step: windows, micro-batches, forward,
           backward, clip, AdamW. At T <= k·W the truncated window is the whole trace, so that row
           would repeat the full one and is left out.
  hf       the peer: the same token ids through transformers' ``AutoModelForCausalLM`` (same weights,
           ``attn_implementation="sdpa"``, full causal attention with no window and no padding mask),
           labels = the ids with the prompt masked (-100), as many whole traces per forward as fit in
           ``micro_batch_tokens``, backward, clip, AdamW — with and without ``gradient_checkpointing_enable()``.

Each row runs in a fresh process (peaks and OOMs stay in their row; forked from a server that has only
imported the libraries, ``run_row``): model load, one warm-up step
(compiles), then ``--steps`` timed steps; ``step_s`` is their median. The warm-up step trains only the
first traces of the group, as many as fill one micro-batch (at least two, so GRPO has an advantage): its
micro-batches have the timed steps' shapes, so it compiles what they run at a fraction of their cost.
Definitions (per step):

  trained tokens    loss tokens: W per trace when truncated cuts the trace, else T (= the Learner's
                    ``num_loss_tokens``); the peer trains the T generated tokens of each trace.
  processed tokens  tokens fed to the model, prompt and truncated context included (the Learner's
                    ``num_tokens``; P + T per trace for the peer). Recomputation is never counted.
  scored rows       rows through the LM head: the Learner's targets; every input for the peer.
  visible keys      the (query, key) pairs the trace's attention rule lets a query see, itself included,
                    summed over windows (``visible_pairs``); one causal document of n tokens has n(n+1)/2.
  tokens/s          trained tokens / step_s; ``proc/s`` = processed tokens / step_s.
  model FLOPs       ``model_flops``:  6·N·processed + 6·d·V·scored + 12·L·H·d_head·visible, where
                    N = the decoder layers' weight matrices (q, k, v, o, gate, up, down; embeddings, norms
                    and LM head excluded: ``layer_params``), d the hidden size, V the vocabulary, L layers,
                    H query heads. Each weight does a multiply-add per token forward (2 FLOPs) and two in
                    backward (grad of input and of weight: 4), hence 6; the LM head is such a matrix
                    (d·V) applied to the scored rows only. Attention per layer, head and visible pair:
                    forward q·k and p·v, 2·d_head FLOPs each (4·d_head); backward dV = pᵀ·dO, dP = dO·vᵀ,
                    dQ = dS·k, dK = dSᵀ·q (8·d_head); 12·d_head in all. Recomputation (checkpointing,
                    the LM head's chunks), padding, masked-out tiles and elementwise work are not counted.
  MFU               model FLOPs / (step_s · 989e12), 989 TFLOP/s being the H200's datasheet dense bf16 peak;
                    ``MFU 6N`` = 6·N·processed / (step_s · 989e12), the field's attention-free count.
  peak GiB          ``torch.cuda.max_memory_allocated`` over the row (model, optimizer state, all steps);
                    on CPU the process's peak RSS.

``--profile NAME`` (a row name such as ``sliderl:truncated:ckpt:32768``) runs that row once more with
torch.profiler over one step after the warm-up and prints device time by kind (FlexAttention, the LM
head's GEMMs, the layers' GEMMs, elementwise, copies, optimizer) and the top kernels.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import re
import resource
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PEAK_FLOPS = 989e12  # H200 dense bf16, the datasheet's (not a measured matmul rate)
GROUP = 8


@dataclass(frozen=True)
class Shape:
    """What the FLOP count needs of a decoder-only transformer."""

    layers: int
    hidden: int
    heads: int  # query heads
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int

    @classmethod
    def of(cls, config) -> Shape:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(config.num_hidden_layers, config.hidden_size, config.num_attention_heads,
                   config.num_key_value_heads, head_dim, config.intermediate_size, config.vocab_size)


def layer_params(s: Shape) -> int:
    """N: weights of the layers' matrices, L·(d·H·dh [q] + 2·d·H_kv·dh [k, v] + H·dh·d [o] + 3·d·I [MLP])."""
    return s.layers * (2 * s.hidden * s.heads * s.head_dim + 2 * s.hidden * s.kv_heads * s.head_dim
                       + 3 * s.hidden * s.intermediate)


def model_flops(s: Shape, processed: int, scored: int, visible: int) -> float:
    """Forward + backward FLOPs: 6·N·processed + 6·d·V·scored + 12·L·H·dh·visible (module docstring)."""
    return (6 * layer_params(s) * processed + 6 * s.hidden * s.vocab * scored
            + 12 * s.layers * s.heads * s.head_dim * visible)


def visible_pairs(positions, death) -> int:
    """(query, key) pairs of one document with ``k ≤ q < death[k]`` (DESIGN.md's rule), each query with itself.

    positions: ``[n]`` increasing; death: ``[n]`` with ``death > positions``. Query i sees the i + 1 keys
    j ≤ i except those already dead (``death[j] ≤ pos[i]``); a key dead by ``pos[i]`` has ``pos[j] < pos[i]``,
    so it is counted by sorting all deaths, O(n log n) instead of the n² mask.
    """
    import torch

    dead = torch.searchsorted(torch.sort(death).values, positions, right=True)  # [n] keys dead at each query
    return int((torch.arange(1, len(positions) + 1) - dead).sum())


# ---------------------------------------------------------------- the batch


def make_traces(prompt: int, length: int, window: int, vocab: int) -> list:
    import torch

    from sliderl.core.trace import Trace

    gen = torch.Generator().manual_seed(0)
    return [Trace(f"t{i}", "g", "p", 0, 0, f"prefix_sliding:{window}",
                  torch.randint(0, vocab, (prompt,), generator=gen).tolist(),
                  torch.randint(0, vocab, (length,), generator=gen).tolist(),
                  [-5.0] * length, "length", reward=float(i)) for i in range(GROUP)]


def learner_counts(traces: list, mode: str, multiplier: int) -> dict:
    """Trained, processed, scored tokens and visible pairs of one step of the Learner on ``traces``."""
    from sliderl.core.kv_policy import KVPolicy
    from sliderl.trainer.logprobs import window_input
    from sliderl.trainer.windows import training_windows

    out = dict(trained=0, processed=0, scored=0, visible=0, largest_window=0)
    for t in traces:
        policy = KVPolicy.parse(t.kv_policy)
        p, n = len(t.prompt_token_ids), len(t.completion_token_ids)
        for w in training_windows(mode, p, n, policy.window, multiplier):
            item = window_input(t.prompt_token_ids, t.completion_token_ids, policy, t.temperature, w)
            pos = w.input_positions()
            out["trained"] += int(w.loss_mask().sum())
            out["processed"] += w.num_inputs
            out["scored"] += w.num_targets
            out["visible"] += visible_pairs(pos, item.death[pos])
            out["largest_window"] = max(out["largest_window"], w.num_inputs)
    return out


def peer_counts(traces: list) -> dict:
    lengths = [len(t.prompt_token_ids) + len(t.completion_token_ids) for t in traces]
    return dict(trained=sum(len(t.completion_token_ids) for t in traces), processed=sum(lengths),
                scored=sum(lengths), visible=sum(n * (n + 1) // 2 for n in lengths), largest_window=max(lengths))


# ---------------------------------------------------------------- one row (child process)


def learner_stepper(args: argparse.Namespace):
    from sliderl.trainer.learner import Learner

    learner = Learner(args.model, window_mode=args.mode, multiplier=args.multiplier,
                      micro_batch_tokens=args.micro_batch_tokens, device=args.device, dtype=args.dtype,
                      attention=args.attention, gradient_checkpointing=args.ckpt, lr=1e-6,
                      compile_elementwise=args.compiled_row)
    return lambda traces: learner.step([traces]).as_dict()


def peer_stepper(args: argparse.Namespace):
    import torch
    from transformers import AutoModelForCausalLM

    from sliderl.core.loader import DTYPES

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=DTYPES[args.dtype], attn_implementation="sdpa")
    model = model.to(args.device).train()
    if args.ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)

    def step(traces: list) -> dict:
        ids = torch.tensor([t.prompt_token_ids + t.completion_token_ids for t in traces], device=args.device)  # [n, L]
        labels = ids.clone()
        labels[:, :args.prompt] = -100
        per_batch = max(1, args.micro_batch_tokens // ids.shape[1])
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for x, y in zip(ids.split(per_batch), labels.split(per_batch)):
            loss = model(input_ids=x, labels=y, use_cache=False).loss * (x.shape[0] / ids.shape[0])
            loss.backward()
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        return {"loss": total}
    return step


def child(args: argparse.Namespace) -> dict:
    """One row in this fresh process: counts, warm-up, timed steps, peak; OOM reported, not raised."""
    import torch
    from transformers import AutoConfig

    shape = Shape.of(AutoConfig.from_pretrained(args.model))
    traces = make_traces(args.prompt, args.length, args.window, shape.vocab)
    counts = learner_counts(traces, args.mode, args.multiplier) if args.stack == "sliderl" else peer_counts(traces)
    row = {"name": args.name, "stack": args.stack, "mode": args.mode, "ckpt": args.ckpt,
           "compiled": args.compiled_row, "T": args.length, "W": args.window, "k": args.multiplier, "P": args.prompt, "group": GROUP, **counts}
    cuda = args.device.startswith("cuda")
    try:
        step = (learner_stepper if args.stack == "sliderl" else peer_stepper)(args)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        step(traces[:max(2, args.micro_batch_tokens // counts["largest_window"])])  # warm-up (module docstring)
        if args.profile:
            return {**row, "status": "ok", "profile": profile_step(lambda: step(traces), shape.vocab, cuda)}
        seconds = []
        for _ in range(args.steps):
            _sync(cuda)
            start = time.perf_counter()
            metrics = step(traces)
            _sync(cuda)
            seconds.append(time.perf_counter() - start)
    except (torch.OutOfMemoryError, RuntimeError) as err:  # the compiler's kernels raise plain RuntimeErrors
        if "out of memory" not in str(err).lower():
            raise
        return {**row, "status": "OOM", "error": str(err).splitlines()[0], "peak_gib": _peak_gib(cuda)}
    if args.stack == "sliderl":  # the Learner's own counts must be the ones the FLOPs use
        assert (metrics["num_tokens"], metrics["num_loss_tokens"]) == (counts["processed"], counts["trained"]), metrics
    return {**row, "status": "ok", **rates(shape, counts, statistics.median(seconds)), "step_s_all": seconds,
            "peak_gib": _peak_gib(cuda), "loss": metrics["loss"]}


def rates(shape: Shape, counts: dict, step_s: float) -> dict:
    """tokens/s, processed/s, model FLOPs and the two MFUs of a step of ``step_s`` seconds (module docstring)."""
    flops = model_flops(shape, counts["processed"], counts["scored"], counts["visible"])
    dense = 6 * layer_params(shape) * counts["processed"]
    return {"step_s": step_s, "tokens_per_s": counts["trained"] / step_s,
            "processed_per_s": counts["processed"] / step_s, "model_flops": flops,
            "mfu": flops / (step_s * PEAK_FLOPS), "mfu_6n": dense / (step_s * PEAK_FLOPS)}


def _sync(cuda: bool) -> None:
    if cuda:
        import torch
        torch.cuda.synchronize()


def _peak_gib(cuda: bool) -> float:
    if cuda:
        import torch
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux: KiB


# ---------------------------------------------------------------- profile


GEMM_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear")
KINDS = [  # (kind, pattern over kernel or op names), first match wins
    ("attention", r"flex|tem_fused|flash|fmha|attention|sdpa|efficient"),
    ("gemm", r"gemm|xmma|cutlass|nvjet|cublas|aten::(mm|addmm|bmm|matmul|linear)\b"),
    ("optimizer", r"adam|foreach|multi_tensor|clip|norm_kernel|aten::_fused_adam"),
    ("copy/index/cat", r"copy|memcpy|memset|cat|index|gather|scatter|fill|pad"),
    ("other triton", r"^triton_"),
    ("elementwise/reduce", r"elementwise|vectorized|reduce|softmax|log|exp|mul|add|silu|rsqrt|pow|mean|sum"),
]


def kind_of(name: str) -> str:
    for kind, pattern in KINDS:
        if re.search(pattern, name, re.IGNORECASE):
            return kind
    return "other"


def group_times(items: list[tuple[str, float]], lm_head_ms: float) -> dict[str, float]:
    """ms by kind over ``(name, ms)`` of kernels (or leaf ops); ``lm_head_ms`` moves from gemm to its own kind."""
    out: dict[str, float] = {}
    for name, ms in items:
        out[kind_of(name)] = out.get(kind_of(name), 0.0) + ms
    if lm_head_ms:
        out["gemm"] = out.get("gemm", 0.0) - lm_head_ms
        out["lm head gemm"] = lm_head_ms
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def profile_step(step, vocab: int, cuda: bool) -> dict:
    """One step under torch.profiler: ms by kind and the top 15 kernels (ops on CPU) by self device time."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities, record_shapes=True) as prof:
        step()
        _sync(cuda)
    events = prof.key_averages(group_by_input_shape=True)
    self_ms = lambda e: (e.self_device_time_total if cuda else e.self_cpu_time_total) / 1e3  # noqa: E731
    # user annotations (inductor's "## Call CompiledFxGraph ... ##" ranges) span kernels counted on their own: left
    # out, as torch's own table leaves them out of its device total
    leaf = [e for e in events if (e.device_type == torch.autograd.DeviceType.CUDA) == cuda and self_ms(e) > 0
            and not getattr(e, "is_user_annotation", False)]
    items = {}
    for e in leaf:
        items[e.key] = items.get(e.key, 0.0) + self_ms(e)
    lm_head = sum(self_ms(e) for e in events if e.key in GEMM_OPS and e.device_type != torch.autograd.DeviceType.CUDA
                  and any(vocab in s for s in e.input_shapes if isinstance(s, list)))
    if not cuda:  # on CPU the GEMM ops are the leaves themselves; avoid counting the LM head's twice
        lm_head = min(lm_head, sum(ms for name, ms in items.items() if kind_of(name) == "gemm"))
    top = sorted(items.items(), key=lambda kv: -kv[1])[:15]
    return {"total_ms": sum(items.values()), "kinds_ms": group_times(list(items.items()), lm_head), "top_ms": top}


def print_profile(row: dict) -> None:
    prof = row["profile"]
    total = prof["total_ms"]
    print(f"\nprofile of {row['name']}: one step, {total:.0f} ms of {'device' if 'cuda' in row['device'] else 'CPU'} "
          "time by kind (self time; the LM head's GEMMs found by a vocabulary-sized operand)")
    for kind, ms in prof["kinds_ms"].items():
        print(f"  {kind:<20} {ms:>10.1f} ms {100 * ms / total:>6.1f}%")
    print("  top kernels (ops on CPU):")
    for name, ms in prof["top_ms"]:
        print(f"  {ms:>10.1f} ms {100 * ms / total:>6.1f}%  {name[:100]}")


# ---------------------------------------------------------------- the table (parent process)


@dataclass(frozen=True)
class RowSpec:
    stack: str  # sliderl | hf
    mode: str  # truncated | full
    ckpt: bool
    length: int
    compiled: bool = False  # sliderl: the Learner's compile_elementwise

    @property
    def name(self) -> str:
        return (f"{self.stack}:{self.mode}:{'ckpt' if self.ckpt else 'nockpt'}:{self.length}"
                + (":compiled" if self.compiled else ""))


def row_specs(lengths: list[int], window: int, multiplier: int, peer: bool,
              compiled: str = "off") -> list[RowSpec]:
    """Every row to run, in order; truncated is left out where it equals full (T <= k·W). ``compiled``: the
    sliderl rows without (off), with (on) or both ways (both) the Learner's compile_elementwise."""
    specs = []
    variants = {"off": (False,), "on": (True,), "both": (False, True)}[compiled]
    for length in lengths:
        modes = ["truncated", "full"] if length > multiplier * window else ["full"]
        for ckpt in (True, False):
            specs += [RowSpec("sliderl", m, ckpt, length, c) for m in modes for c in variants]
            specs += [RowSpec("hf", "full", ckpt, length)] if peer else []
    return specs


def run_row(args: argparse.Namespace, spec: RowSpec, timeout: float, profile: bool = False) -> dict:
    """``child`` for ``spec`` in a fresh process, forked from a server that has only imported the libraries
    (no CUDA state, no model; saves their import time per row); killed after ``timeout`` seconds."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch._dynamo", "transformers", "trainer.learner"])
    row_args = argparse.Namespace(**{**vars(args), "stack": spec.stack, "mode": spec.mode, "ckpt": spec.ckpt,
                                     "length": spec.length, "name": spec.name, "profile": profile,
                                     "compiled_row": spec.compiled})
    receive, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child_main, args=(row_args, send))
    base = {"name": spec.name, "stack": spec.stack, "mode": spec.mode, "ckpt": spec.ckpt, "compiled": spec.compiled,
            "T": spec.length, "device": args.device}
    start = time.perf_counter()
    proc.start()
    send.close()
    try:
        result = receive.recv() if receive.poll(timeout) else {"status": "TIMEOUT", "error": f"over {timeout:.0f} s"}
    except EOFError:  # the child died without an answer (killed, crashed)
        result = None
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join()
    if result is None:
        result = {"status": "FAILED", "error": f"the row's process exited with code {proc.exitcode}"}
    return {**base, **result, "row_wall_s": time.perf_counter() - start}


def _child_main(args: argparse.Namespace, conn) -> None:
    os.environ["HF_HUB_OFFLINE"] = "1"
    sys.path.insert(0, str(ROOT))
    try:
        conn.send(child(args))
    except Exception as err:  # noqa: BLE001  any failure becomes the row's status, the table goes on
        conn.send({"status": "FAILED", "error": f"{type(err).__name__}: {err}"[:300]})


def run_within_budget(args: argparse.Namespace, spec: RowSpec, start: float, profile: bool = False) -> dict:
    """``run_row`` with a timeout of ``--row-timeout-s`` capped by what is left of ``--budget-s`` since
    ``start``; SKIPPED when under 20 s are left."""
    left = math.inf if args.budget_s is None else args.budget_s - (time.perf_counter() - start)
    if left < 20:
        return {"name": spec.name, "status": "SKIPPED", "error": f"time budget of {args.budget_s:.0f} s spent"}
    return run_row(args, spec, min(args.row_timeout_s, left), profile)


def format_row(r: dict) -> str:
    head = f"{r['name']:<30}"
    if r["status"] != "ok":
        size = f" (attempted {r['processed']} tokens, largest window {r['largest_window']})" if "processed" in r else ""
        return f"{head} {r['status']}{size} {r.get('error', '')[:120]}"
    return (f"{head} {r['step_s']:>8.2f} {r['tokens_per_s']:>9.0f} {r['processed_per_s']:>9.0f} "
            f"{100 * r['mfu']:>6.1f}% {100 * r['mfu_6n']:>6.1f}% {r['peak_gib']:>8.1f}")


def build_model(args: argparse.Namespace, root: Path) -> str:
    from sliderl.core.tiny import make_qwen3_1p7b, make_tiny_model

    if args.tiny:
        return str(make_tiny_model(root / "model", "qwen3", hidden_size=128, num_layers=2, num_heads=4,
                                   num_kv_heads=2, intermediate_size=256, max_position_embeddings=4096))
    return str(make_qwen3_1p7b(root / "model", device=args.device))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768], help="T, generated tokens per trace")
    parser.add_argument("--window", type=int, default=4096)
    parser.add_argument("--multiplier", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--steps", type=int, default=2, help="timed steps per row after one warm-up; median")
    parser.add_argument("--micro-batch-tokens", type=int, default=32768)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--attention", default="flex", help="the Learner's attention backend")
    parser.add_argument("--no-peer", dest="peer", action="store_false", help="leave out the transformers rows")
    parser.add_argument("--rows", nargs="+", help="run only these row names (e.g. sliderl:truncated:ckpt:32768)")
    parser.add_argument("--row-timeout-s", type=float, default=240.0)
    parser.add_argument("--budget-s", type=float, default=None,
                        help="skip the rows that would start after this many seconds; cap each row's timeout by it")
    parser.add_argument("--profile", metavar="NAME", help="also profile one step of this row")
    parser.add_argument("--compiled", choices=("off", "on", "both"), default="off",
                        help="sliderl rows with the Learner's compile_elementwise off, on, or a row each way "
                             "(names end in ':compiled')")
    parser.add_argument("--tiny", action="store_true",
                        help="tiny Qwen3 on CPU in float32, T 256/512, W 64, P 16, SDPA, 1 timed step")
    parser.add_argument("--out", type=Path, help="write rows.jsonl (and profile.json) into this directory")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    if args.tiny:
        args.lengths, args.window, args.prompt, args.device, args.dtype = [256, 512], 64, 16, "cpu", "float32"
        args.attention, args.micro_batch_tokens, args.steps = "sdpa", 1024, 1
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    sys.path.insert(0, str(ROOT))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))  # the server's
    start = time.perf_counter()
    specs = [s for s in row_specs(args.lengths, args.window, args.multiplier, args.peer, args.compiled)
             if not args.rows or s.name in args.rows]
    unknown = sorted(set(args.rows or ()) - {s.name for s in specs})
    if unknown:  # a misspelt row (or one --compiled / --no-peer leaves out) would run nothing, silently
        names = [s.name for s in row_specs(args.lengths, args.window, args.multiplier, args.peer, args.compiled)]
        raise SystemExit(f"--rows {unknown} name no row of this run; rows: {names}")
    profile_spec = None
    if args.profile:
        every = row_specs(args.lengths, args.window, args.multiplier, True, "both")
        profile_spec = next((s for s in every if s.name == args.profile), None)
        if profile_spec is None:
            raise SystemExit(f"--profile {args.profile!r} names no row; rows: {[s.name for s in every]}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        args.model = build_model(args, Path(tmp))
        print(f"Qwen3 {'tiny' if args.tiny else '1.7B config'}, GROUP of {GROUP} prefix_sliding:{args.window} traces, "
              f"P={args.prompt}, k={args.multiplier}, micro_batch_tokens={args.micro_batch_tokens}, {args.device} "
              f"{args.dtype}, attention {args.attention}, median of {args.steps} steps after 1 warm-up", flush=True)
        for spec in specs:
            rows.append(run_within_budget(args, spec, start))
            print(json.dumps(rows[-1]), flush=True)
        profiled = run_within_budget(args, profile_spec, start, profile=True) if profile_spec else None
    print(f"\n{'row':<30} {'step s':>8} {'tok/s':>9} {'proc/s':>9} {'MFU':>7} {'MFU 6N':>7} {'peak GiB':>8}")
    for r in rows:
        print(format_row(r))
    if profiled is not None:
        print_profile(profiled) if profiled["status"] == "ok" else print(f"\nprofile: {format_row(profiled)}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        if profiled is not None:
            (args.out / "profile.json").write_text(json.dumps(profiled, indent=1))
    print(f"total {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
