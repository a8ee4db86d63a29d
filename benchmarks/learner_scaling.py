"""A sharded learner's throughput, memory and weight-sync time at 1 and N ranks (issue 36), at the same global batch.

    python benchmarks/learner_scaling.py --shape 1.7b --ranks 1 2 --seq 8192 32768 --out DIR      # 2 GPUs
    python benchmarks/learner_scaling.py --shape 7b --ranks 1 --seq 32768 --fsdp always --out DIR # 1 GPU, 7B
    python benchmarks/learner_scaling.py --shape 1.7b --ranks 1 2 --seq 8192 --sync --out DIR     # + sync time
    python benchmarks/learner_scaling.py --cpu-smoke --out DIR        # CPU, gloo, a tiny model: the script runs

A row is one (ranks, T) case: ``ranks`` processes, one GPU each (``CUDA_VISIBLE_DEVICES``), joined in one
process group (NCCL; gloo on CPU) whose rendezvous store this script serves, each a
``trainer.learner.Learner`` with ``trainer.parallel.FSDPParallel`` (at one rank the plain learner unless
``--fsdp always`` or ``--offload cpu``). The global batch is the same at every rank count: ``--groups``
GRPO groups of ``--group`` synthetic traces (``benchmarks.learner_gpu.make_traces``: a prompt of ``--prompt``
(256) tokens then T - 256 generated, random ids, rewards 0..group-1, ``prefix_sliding:--window``), trained with
``window_mode --mode`` (full: every token of every trace; truncated: the last k·W), bf16 with float32
masters (``--no-masters``: AdamW on the bf16 weights), activation checkpointing (of the first
``--checkpoint-layers`` layers; default all; ``--compiled``: the element-wise chains compiled), one trace
per micro-batch (``micro_batch_tokens`` = T unless ``--micro-batch-tokens``). Every rank steps
on all the groups; the learner splits them by tokens. One warm-up step (compiles FlexAttention), then
``--steps`` timed steps.

Columns: ``step_s`` the timed steps' median; ``tok/s`` processed tokens (every rank's inputs: the Learner's
``num_tokens``) per second; ``peak GiB`` per rank (``StepMetrics.rank_peak_memory_gib``, the largest over the
timed steps); ``MFU`` = ``benchmarks.learner_gpu.model_flops`` (6·N·processed + 6·d·V·scored +
12·L·H·dh·visible pairs: recomputation not counted) / (step_s · 989e12 · ranks), 989 TFLOP/s being the
H200 SXM's dense bf16 peak (learner_gpu.py divides by 790e12; the FLOPs are the same). ``scaling`` = this
row's tok/s over the 1-rank row's at the same T.

``--profile``: after the timed steps, one more step with rank 0 under torch.profiler
(``benchmarks.learner_gpu.profile_step``): its device time by kind goes into the row (``profile``) and is printed
after the table; the timed steps are not profiled.

``--sync``: after the steps, the weights go to a receiver process (``WeightReceiver`` over NCCL; gloo on
CPU) the way a run's weight sync does (``weight_sync.backend=broadcast``): learner rank 0 and the receiver
form the weights group, every learner rank gathers the weights one FSDP2 unit at a time (one segment at one
rank: today's learner) and rank 0 broadcasts each; ``sync_s`` is the median of ``--sync-repeats`` publishes
after one warm-up, timed on rank 0 from the first gather to the last broadcast's completion. The receiver
runs on the last learner rank's GPU (GPU 1 at one rank), a process of its own.

Results: one JSON object per row in ``OUT/results.jsonl`` and a table on stdout. A row whose processes fail
(an OOM) gets ``status`` and the tail of their output instead of numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PEAK_FLOPS = 989e12  # H200 SXM, dense bf16
SHAPES = ("1.7b", "7b", "tiny")
# DeepSeek-R1-Distill-Qwen-7B's config.json (a Qwen2.5-Math-7B: 7.6B parameters, untied head)
QWEN2_7B = dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=131072, rms_norm_eps=1e-6,
                rope_theta=10000.0, tie_word_embeddings=False, use_sliding_window=False, sliding_window=4096,
                max_window_layers=28, bos_token_id=151646, eos_token_id=151643)


# ---------------------------------------------------------------- models


def build_model(shape: str, root: Path, device: str) -> Path:
    """The shape's config with random weights (bf16, seed 0) and the byte tokenizer, built once under ``root``."""
    import torch

    from sliderl.core.tiny import build_tokenizer, make_qwen3_1p7b, make_tiny_model

    out = root / f"model-{shape}"
    if (out / "config.json").is_file():
        return out
    if shape == "tiny":
        return make_tiny_model(out, "qwen3", hidden_size=64, num_layers=2, tie_word_embeddings=False)
    if shape == "1.7b":
        return make_qwen3_1p7b(out, device=device)
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(Qwen2Config(**QWEN2_7B), dtype=torch.bfloat16)
    model.save_pretrained(out)
    build_tokenizer().save_pretrained(str(out))
    del model
    if device == "cuda":
        torch.cuda.empty_cache()  # the rows' processes need the GPU
    return out


# ---------------------------------------------------------------- one rank (its own process)


def rank_main(args: argparse.Namespace) -> None:
    """One learner rank (``--role rank``) or the sync receiver (``--role receiver``)."""
    import torch

    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    if args.role == "receiver":
        return receiver_main(args)
    from benchmarks.learner_gpu import make_traces
    from sliderl.trainer.learner import Learner
    from sliderl.trainer.learner_args import LearnerArgs
    from sliderl.trainer.parallel import FSDPParallel, Parallel, ProcessGroupSpec, process_group_backend

    device = "cpu" if args.cpu_smoke else "cuda"
    sharded = args.world > 1 or args.fsdp == "always" or args.offload != "none"
    spec = ProcessGroupSpec(args.address, args.world, process_group_backend(device), 1800,
                            hsdp_shard(args.shard_ranks, args.world))
    loading = time.perf_counter()
    parallel = FSDPParallel.join(spec, args.rank, torch.device(device)) if sharded else Parallel()
    learner = Learner(args.model, LearnerArgs(
        lr=1e-6, device=device, dtype="float32" if args.cpu_smoke else "bfloat16", master_weights=args.masters,
        gradient_checkpointing=True, checkpoint_layers=args.checkpoint_layers, compile_elementwise=args.compiled,
        gradient_sync=args.gradient_sync,
        window_mode=args.mode, micro_batch_tokens=args.micro_batch_tokens or args.seq, offload=args.offload,
        vocab_policy=None), parallel=parallel)
    vocab = learner.model.config.vocab_size
    groups = [make_traces(args.prompt, args.seq - args.prompt, args.window, min(vocab, 256 * 256))[:args.group]
              for _ in range(args.groups)]
    started = time.perf_counter()
    progress = lambda what: print(f"rank {args.rank}: {what} at {time.perf_counter() - started:.0f} s", flush=True)  # noqa: E731
    progress(f"model loaded and sharded in {started - loading:.0f} s ({torch.get_num_threads()} CPU threads)")
    if args.offload != "none":
        trace_phases(learner, progress)
    learner.step(groups)  # warm-up: compiles
    progress("warm-up step done")
    metrics = []
    for i in range(args.steps):
        metrics.append(learner.step(groups))
        progress(f"step {i + 1} of {args.steps} done ({metrics[-1].step_seconds:.1f} s)")
    row = {"step_s": statistics.median(m.step_seconds for m in metrics), "num_tokens": metrics[-1].num_tokens,
           "num_loss_tokens": metrics[-1].num_loss_tokens, "peak_gib": _peaks(metrics)}
    if args.sync:
        row["sync_s"] = sync_seconds(args, learner)
    if args.rank == 0:
        Path(args.row_file).write_text(json.dumps(row))
    if args.profile:  # one more step, every rank stepping, rank 0 under torch.profiler; the row is already written
        from benchmarks.learner_gpu import profile_step

        if args.rank == 0:
            row["profile"] = profile_step(lambda: learner.step(groups), vocab, device == "cuda")
            Path(args.row_file).write_text(json.dumps(row))
        else:
            learner.step(groups)
        progress("profiled step done")
    parallel.barrier()  # every rank done before any leaves; then no interpreter teardown, where a gloo thread of
    sys.stdout.flush()  # a 2D mesh's subgroups has aborted a finished rank (tests/learner_ranks.py)
    os._exit(0)


def trace_phases(learner, progress) -> None:
    """Print when each decoder layer 0 forward (one per micro-batch, and its recomputation under checkpointing) and
    each optimizer step start and end: where an offloaded step's time goes, as it happens."""
    import itertools

    calls = itertools.count(1)
    learner.model.model.layers[0].register_forward_pre_hook(lambda module, inputs: progress(
        f"layer 0 forward {next(calls)}"))
    step = learner.optimizer.step

    def timed_step(*args, **kwargs):
        progress("optimizer step starts")
        out = step(*args, **kwargs)
        progress("optimizer step done")
        return out

    learner.optimizer.step = timed_step


def _peaks(metrics) -> list[float] | None:
    ranks = [m.rank_peak_memory_gib for m in metrics if m.rank_peak_memory_gib]
    return [round(max(p[r] for p in ranks), 2) for r in range(len(ranks[0]))] if ranks else None


def sync_seconds(args: argparse.Namespace, learner) -> float:
    """Rank 0 publishes to the receiver ``--sync-repeats`` + 1 times; the median seconds of all but the first."""
    import torch
    import torch.distributed as dist

    from sliderl.cluster.actors.weight_sync import FlatLayout, WeightSender

    store = _store(args)
    layout = FlatLayout.of_segments(learner.weight_segments())  # every rank: the gathering is a collective
    sender = WeightSender("broadcast", learner.device)
    if args.rank == 0:
        store.set("layout", pickle.dumps(layout))
        sender.join(args.weights_address, 2, "bench-weights", "nccl" if learner.device.type == "cuda" else "gloo",
                    600)
    seconds = []
    for version in range(args.sync_repeats + 1):
        if dist.is_initialized():
            dist.barrier()
        start = time.perf_counter()
        sender.publish(version, learner.weight_segments(), sends=args.rank == 0)
        if learner.device.type == "cuda":
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds[1:])


def receiver_main(args: argparse.Namespace) -> None:
    import torch

    from sliderl.cluster.actors.weight_sync import BroadcastNotice, WeightReceiver

    store = _store(args)
    layout = pickle.loads(store.get("layout"))
    device = "cpu" if args.cpu_smoke else "cuda"
    receiver = WeightReceiver(device)
    receiver.join(args.weights_address, 2, 1, "bench-weights", "nccl" if device == "cuda" else "gloo", 600)
    for version in range(args.sync_repeats + 1):
        receiver.receive(BroadcastNotice(version, layout))
        if device == "cuda":
            torch.cuda.synchronize()


def _store(args: argparse.Namespace):
    import datetime

    import torch.distributed as dist

    host, port = args.address.rsplit(":", 1)
    return dist.PrefixStore("bench", dist.TCPStore(host, int(port), None, False,
                                                   timeout=datetime.timedelta(seconds=1800)))


# ---------------------------------------------------------------- the driver


def run_row(args: argparse.Namespace, model: Path, ranks: int, seq: int, out: Path) -> dict:
    from sliderl.trainer.parallel import open_rendezvous

    store, address = open_rendezvous("127.0.0.1")
    weights_store, weights_address = open_rendezvous("127.0.0.1")  # the sync's own group (rank 0 + receiver)
    row_file = out / f"row-{ranks}-{seq}.json"
    row_file.unlink(missing_ok=True)
    common = [sys.executable, __file__, "--model", str(model), "--world", str(ranks), "--address", address,
              "--weights-address", weights_address, "--seq", str(seq), "--row-file", str(row_file),
              *_passed(args)]
    procs, logs = [], []
    roles = [("rank", r, r) for r in range(ranks)] + ([("receiver", 0, max(ranks - 1, 1))] if args.sync else [])
    # offloaded, AdamW and the gradient accumulation run on the host: give each process its share of the cores
    # (with one thread each, the 7B step's first offloaded call had not finished its warm-up step after ~450 s)
    threads = max(1, (os.cpu_count() or 1) // len(roles)) if args.offload == "cpu" else 1
    for role, rank, gpu in roles:
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
        if not args.cpu_smoke:
            env["CUDA_VISIBLE_DEVICES"] = str(gpu)
        log = open(out / f"{role}{rank}-{ranks}-{seq}.log", "w")
        logs.append(log)
        procs.append(subprocess.Popen([*common, "--role", role, "--rank", str(rank)], env=env, stdout=log,
                                      stderr=subprocess.STDOUT))
    codes = wait_all(procs, time.monotonic() + args.row_timeout_s)
    for log in logs:
        log.close()
    del store, weights_store
    row = {"shape": args.shape, "ranks": ranks, "seq": seq, "group": args.group, "groups": args.groups,
           "mode": args.mode, "prompt": args.prompt, "window": args.window, "offload": args.offload, "fsdp": args.fsdp,
           "masters": args.masters, "checkpoint_layers": args.checkpoint_layers, "compiled": args.compiled,
           "gradient_sync": args.gradient_sync,
           "shard_ranks": hsdp_shard(args.shard_ranks, ranks),
           "micro_batch_tokens": args.micro_batch_tokens or seq}
    if codes != [0] * len(procs) or not row_file.is_file():
        tail = (out / f"rank0-{ranks}-{seq}.log").read_text()[-2000:]
        return {**row, "status": f"failed {codes}", "tail": tail}
    return {**row, "status": "ok", **json.loads(row_file.read_text())}


def wait_all(procs: list[subprocess.Popen], deadline: float) -> list:
    """Every process's exit code; once one fails (or the deadline passes) the others are killed, since they
    would wait for it in a collective."""
    while any(p.poll() is None for p in procs):
        failed = any(p.returncode not in (None, 0) for p in procs)
        if failed or time.monotonic() > deadline:
            for p in procs:
                if p.poll() is None:
                    p.kill()
            break
        time.sleep(0.5)
    return [p.wait() if time.monotonic() <= deadline else "timeout" for p in procs]


def _passed(args: argparse.Namespace) -> list[str]:
    """The options every process of a row gets as they are."""
    out = ["--shape", args.shape, "--group", str(args.group), "--groups", str(args.groups), "--steps", str(args.steps),
           "--prompt", str(args.prompt),
           "--mode", args.mode, "--window", str(args.window), "--offload", args.offload, "--fsdp", args.fsdp,
           "--sync-repeats", str(args.sync_repeats)]
    out += ["--checkpoint-layers", str(args.checkpoint_layers)] if args.checkpoint_layers is not None else []
    out += ["--micro-batch-tokens", str(args.micro_batch_tokens)] if args.micro_batch_tokens else []
    out += ["--no-masters"] if not args.masters else []
    out += ["--compiled"] if args.compiled else []
    out += ["--gradient-sync", args.gradient_sync]
    out += ["--shard-ranks", str(args.shard_ranks)] if args.shard_ranks else []
    out += ["--profile"] if args.profile else []
    return out + (["--sync"] if args.sync else []) + (["--cpu-smoke"] if args.cpu_smoke else [])


def add_rates(rows: list[dict], model: Path) -> list[dict]:
    """tok/s, MFU and scaling (over the 1-rank row of the same T) of every ok row."""
    from transformers import AutoConfig

    from benchmarks.learner_gpu import Shape, layer_params, learner_counts, make_traces, model_flops

    shape = Shape.of(AutoConfig.from_pretrained(model, local_files_only=True))
    for row in rows:
        if row["status"] != "ok":
            continue
        traces = make_traces(row["prompt"], row["seq"] - row["prompt"], row["window"], min(shape.vocab, 256 * 256))
        traces = traces[:row["group"]]
        counts = learner_counts(traces, row["mode"], 4)
        flops = model_flops(shape, counts["processed"], counts["scored"], counts["visible"]) * row["groups"]
        row["tok_s"] = row["num_tokens"] / row["step_s"]
        row["mfu"] = flops / (row["step_s"] * PEAK_FLOPS * row["ranks"])
        # 6·N·processed alone (the weight matrices), as learner_gpu's "MFU 6N"
        dense = 6 * layer_params(shape) * counts["processed"] * row["groups"]
        row["mfu_6n"] = dense / (row["step_s"] * PEAK_FLOPS * row["ranks"])
    for row in rows:
        base = next((r for r in rows if r["status"] == "ok" and r["ranks"] == 1 and r["seq"] == row["seq"]), None)
        if row["status"] == "ok" and base is not None:
            row["scaling"] = row["tok_s"] / base["tok_s"]
    return rows


def hsdp_shard(shard_ranks: int | None, ranks: int) -> int | None:
    """``--shard-ranks`` where it makes a row HSDP (it divides the row's ranks into more than one copy), else None."""
    return shard_ranks if shard_ranks and ranks % shard_ranks == 0 and shard_ranks < ranks else None


def setup_label(row: dict) -> str:
    """The row's memory settings in a few characters: ``masters ckpt:all`` (float32 masters, every layer
    recomputed) or ``plain ckpt:12 comp`` (AdamW on the weights, 12 layers recomputed, compiled chains)."""
    layers = row.get("checkpoint_layers")
    label = f"{'masters' if row.get('masters', True) else 'plain'} ckpt:{'all' if layers is None else layers}"
    label += " comp" if row.get("compiled") else ""
    label += " sync:step" if row.get("gradient_sync") == "step" else ""
    label += f" hsdp:{row['shard_ranks']}" if row.get("shard_ranks") else ""
    return label + (f" off:{row['offload']}" if row.get("offload", "none") != "none" else "")


def table(rows: list[dict]) -> str:
    lines = [f"{'shape':>5} {'ranks':>5} {'T':>6} {'setup':>22} {'status':>8} {'step_s':>8} {'tok/s':>9} "
             f"{'scaling':>7} {'MFU':>6} {'MFU 6N':>6} {'sync_s':>7}  peak GiB per rank"]
    for r in rows:
        setup = setup_label(r)
        if r["status"] != "ok":
            lines.append(f"{r['shape']:>5} {r['ranks']:>5} {r['seq']:>6} {setup:>22} {r['status']:>8}")
            continue
        sync = f"{r['sync_s']:.4f}" if "sync_s" in r else "-"
        lines.append(f"{r['shape']:>5} {r['ranks']:>5} {r['seq']:>6} {setup:>22} {'ok':>8} {r['step_s']:8.3f} "
                     f"{r['tok_s']:9.0f} {r.get('scaling', float('nan')):7.2f} {r['mfu']:6.1%} {r['mfu_6n']:6.1%} {sync:>7}  "
                     f"{r['peak_gib']}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=SHAPES, default="1.7b")
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    p.add_argument("--seq", type=int, nargs="+", default=[8192, 32768], help="T: tokens per trace")
    p.add_argument("--group", type=int, default=8, help="traces per group")
    p.add_argument("--prompt", type=int, default=256, help="prompt tokens of each trace (of its T)")
    p.add_argument("--groups", type=int, default=1, help="groups per step (the global batch: groups x group traces)")
    p.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up")
    p.add_argument("--mode", choices=("full", "truncated"), default="full")
    p.add_argument("--window", type=int, default=1024, help="W of the traces' prefix_sliding policy")
    p.add_argument("--offload", choices=("none", "cpu"), default="none")
    p.add_argument("--fsdp", choices=("auto", "always"), default="auto")
    p.add_argument("--checkpoint-layers", type=int, default=None,
                   help="recompute only the first K decoder layers (learner.checkpoint_layers); default every layer")
    p.add_argument("--micro-batch-tokens", type=int, default=None,
                   help="learner.micro_batch_tokens; default T (one trace, or several truncated windows, a "
                        "micro-batch)")
    p.add_argument("--no-masters", dest="masters", action="store_false",
                   help="AdamW on the bf16 weights (no float32 masters: 8 B/param less; the MFU rows at 7B on one GPU)")
    p.add_argument("--compiled", action="store_true", help="learner.compile_elementwise on")
    p.add_argument("--shard-ranks", type=int, default=None,
                   help="learner.shard_ranks: ranks per copy of the state (HSDP); default all of a row's ranks")
    p.add_argument("--gradient-sync", choices=("micro_batch", "step"), default="micro_batch",
                   help="learner.gradient_sync: sum (and, offloaded, copy to host) the gradients after every "
                        "micro-batch or once a step")
    p.add_argument("--profile", action="store_true",
                   help="after the timed steps, one more step with rank 0 under torch.profiler: device time by kind "
                        "(GEMMs, the LM head's, attention, compiled element-wise, optimizer) in the row and printed")
    p.add_argument("--sync", action="store_true", help="also time the weight sync to a receiver process")
    p.add_argument("--sync-repeats", type=int, default=5)
    p.add_argument("--row-timeout-s", type=float, default=1800)
    p.add_argument("--out", type=Path, default=Path("runs/learner_scaling"))
    p.add_argument("--models", type=Path, help="build (or reuse) the random model under this folder instead of --out "
                                               "(on the GPU machine: outside the folder whose files come back)")
    p.add_argument("--cpu-smoke", action="store_true", help="CPU, gloo, a tiny model, T 64: the script runs")
    # one process of a row (set by run_row)
    p.add_argument("--role", choices=("rank", "receiver"))
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--world", type=int, default=1)
    p.add_argument("--address")
    p.add_argument("--weights-address")
    p.add_argument("--model")
    p.add_argument("--row-file")
    args = p.parse_args(argv)
    if args.cpu_smoke and args.role is None:
        args.shape, args.seq, args.prompt, args.window, args.steps, args.sync_repeats = "tiny", [64], 16, 16, 1, 1
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.role is not None:
        args.seq = args.seq[0]
        return rank_main(args)
    args.out.mkdir(parents=True, exist_ok=True)
    # initialised on the GPU (a 7B's random init on the CPU takes minutes), then freed: this process keeps only its
    # CUDA context while the rows run
    built = time.perf_counter()
    model = build_model(args.shape, args.models or args.out, "cpu" if args.cpu_smoke else "cuda")
    print(f"model {model} ready in {time.perf_counter() - built:.0f} s", flush=True)
    rows = add_rates([run_row(args, model, ranks, seq, args.out) for seq in args.seq for ranks in args.ranks], model)
    with (args.out / "results.jsonl").open("a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    print(table(rows), flush=True)
    for row in rows:
        if "profile" in row:
            from benchmarks.learner_gpu import print_profile

            print_profile({**row, "name": f"{row['shape']} {row['ranks']} rank(s) T {row['seq']} {setup_label(row)}",
                           "device": "cpu" if args.cpu_smoke else "cuda"})


if __name__ == "__main__":
    main()
