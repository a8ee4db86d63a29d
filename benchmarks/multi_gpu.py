"""Issue 6: disaggregated training on several GPUs — learner on one GPU, rollout workers on the others.

Part 1 — weight sync of a Qwen3-1.7B-config model (random bf16 weights, 3.4 GB): seconds per
version from the learner to every worker, NCCL broadcast against the Ray object store, median of
``--repeats`` after a warm-up.

Part 2 — the same training work in ``sync`` and ``async`` mode (``cluster.run.driver.train``): GRPO on
the arithmetic task's prompts with the same random 1.7B model (random weights: the point is
throughput; stop tokens every 8th id give completions of varying length, so rewards vary and every
step trains), learner in bf16 on GPU 0, one rollout worker per other GPU, weights synced by NCCL
broadcast every step. Reported per mode: loop seconds from the end of step 1 to the last step (the
first step pays FlexAttention's compilation), rollout tokens/s per GPU, learner utilisation (learner
step seconds over loop seconds), weight-sync seconds, groups trained and dropped.

    python benchmarks/multi_gpu.py [--steps 6] [--groups 8] [--group-size 8] [--max-tokens 256] [--cpu-smoke]
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

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

STOP_IDS = list(range(0, 256, 8))


def build_model(root: Path, smoke: bool) -> Path:
    """The Qwen3-1.7B-config model of benchmarks/engine_gpu.py (or a tiny one for --cpu-smoke)."""
    from sliderl.core.tiny import make_tiny_model
    if smoke:
        return make_tiny_model(root, "qwen3", hidden_size=64, num_layers=2)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from engine_gpu import build_model as build_qwen3_1p7b
    return build_qwen3_1p7b(root)


def placement(args) -> list[str]:
    dev, gpus = ("cpu", 0) if args.cpu_smoke else ("cuda", 1)
    dtype = "float32" if args.cpu_smoke else "bfloat16"
    return [f"learner.device={dev}", f"engine.device={dev}", f"learner.num_gpus={gpus}", f"rollout.num_gpus={gpus}",
            f"learner.dtype={dtype}", f"engine.dtype={dtype}", "learner.num_cpus=1", "rollout.num_cpus=1",
            f"rollout.num_workers={args.workers}", "monitor.wandb.mode=disabled", "monitor.include_dashboard=false",
            "monitor.plots=false", "warmstart.enabled=false", "model.type=hf"]


def time_sync(args, model_dir: Path, backend: str) -> dict:
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    from sliderl.cluster.actors.learner_group import make_learner
    from sliderl.cluster.actors.placement import make_queue
    from sliderl.cluster.actors.rollout_worker import make_worker
    from sliderl.cluster.actors.weight_sync import WeightSync
    from sliderl.cluster.config.base import load_config
    from sliderl.cluster.config.train import TrainConfig

    cfg = load_config(TrainConfig, None, placement(args) + [
        f"model.path={model_dir}", f"weight_sync.backend={backend}", "engine.num_blocks=256"])
    gpu = {} if args.cpu_smoke else {"GPU": 1.0}
    pg = placement_group([{"CPU": 1.0, **gpu}] * (args.workers + 1), strategy="PACK")
    ray.get(pg.ready())
    queue = make_queue(cfg)
    learner = make_learner(cfg, pg, str(model_dir))
    workers = {w: make_worker(cfg, pg, w, str(model_dir), 0, queue) for w in range(args.workers)}
    try:
        ray.get([w.status.remote() for w in workers.values()] + [learner.version.remote()])
        device = "cpu" if args.cpu_smoke else "cuda"
        sync = WeightSync(backend, "gloo" if args.cpu_smoke else "nccl", device, timeout_s=600)
        seconds = [sync.publish(0, learner, workers).seconds for _ in range(args.repeats + 1)][1:]  # the learner holds version 0
    finally:
        learner.kill()
        for actor in [queue.actor, *workers.values()]:
            ray.kill(actor, no_restart=True)
        remove_placement_group(pg)
    return {"backend": backend, "median_s": statistics.median(seconds), "min_s": min(seconds), "max_s": max(seconds)}


def run_mode(args, model_dir: Path, scratch: Path, mode: str) -> dict:
    from sliderl.cluster.config.base import load_config
    from sliderl.cluster.config.train import TrainConfig
    from sliderl.cluster.run.driver import train

    run_dir = scratch / f"run-{mode}"
    cfg = load_config(TrainConfig, None, placement(args) + [
        f"model.path={model_dir}", f"run_dir={run_dir}", "task.num_steps=[2,4]", "task.train_size=512",
        "eval.before=false", "eval.after=false", f"sampling.max_tokens={args.max_tokens}",
        f"sampling.stop_token_ids={json.dumps(STOP_IDS)}", "engine.kv=prefix_sliding:128",
        f"engine.num_blocks={4096 if not args.cpu_smoke else 1024}", "engine.max_num_seqs=256",
        "reward={correctness: 1.0, kv_penalty: {budget: 1, weight: 0.01}}", "weight_sync.backend=broadcast",
        f"train.mode={mode}", f"train.steps={args.steps}", f"train.groups_per_step={args.groups}",
        f"rollout.group_size={args.group_size}", f"rollout.max_inflight_groups={args.groups}",
        f"rollout.queue_size={2 * args.groups}", "learner.lr=1e-6", "learner.micro_batch_tokens=16384",
        "train.max_staleness=1", "checkpoint.every=0",
    ])
    start = time.perf_counter()
    result = train(cfg)
    total = time.perf_counter() - start
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "learner_step_seconds" in r]
    loop = rows[-1]["elapsed_s"] - rows[0]["elapsed_s"]
    busy = sum(r["learner_step_seconds"] for r in rows[1:])
    syncs = [r["weight_sync_seconds"] for r in rows[1:] if "weight_sync_seconds" in r]
    return {"mode": mode, "loop_s": loop, "train_call_s": total, "steps": result.state.step,
            "trained_groups": len(result.state.ledger.trained), "stale_dropped": len(result.state.ledger.stale),
            "rollout_tok_s_per_gpu": statistics.mean(r["rollout_tokens_per_s"] for r in rows[1:]) / args.workers,
            "learner_util": busy / max(loop, 1e-9), "sync_s": statistics.mean(syncs) if syncs else float("nan")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workers", type=int, default=None, help="rollout workers (default: GPUs - 1)")
    parser.add_argument("--skip-modes", action="store_true")
    parser.add_argument("--skip-sync", action="store_true", help="skip part 1 (weight-sync timing)")
    parser.add_argument("--cpu-smoke", action="store_true", help="plumbing check on CPU with a tiny model")
    args = parser.parse_args()

    import ray
    import torch

    from sliderl.cluster.actors.placement import start_local_ray
    gpus = torch.cuda.device_count()
    if not args.cpu_smoke and gpus < 2:
        raise SystemExit(f"needs at least 2 GPUs (learner + a rollout worker), found {gpus}")
    args.workers = args.workers or (1 if args.cpu_smoke else gpus - 1)
    scratch = Path(tempfile.mkdtemp(prefix="sliderl-mgpu-"))
    model = build_model(scratch / "model", args.cpu_smoke)
    start_local_ray(num_cpus=max(4, args.workers + 2), num_gpus=gpus, include_dashboard=False, log_to_driver=False)
    print(f"# multi_gpu {time.strftime('%Y-%m-%d %H:%M')} torch {torch.__version__} ray {ray.__version__} "
          f"gpus {gpus} x {torch.cuda.get_device_name() if gpus else 'none'}; rollout workers {args.workers}", flush=True)
    print("\n## weight sync per version (learner -> every worker)")
    for backend in () if args.skip_sync else ("broadcast", "object_store"):
        r = time_sync(args, model, backend)
        print(f"{backend:<14} median {r['median_s']:.3f} s  (min {r['min_s']:.3f}, max {r['max_s']:.3f})", flush=True)
    if not args.skip_modes:
        print(f"\n## same work, sync vs async: {args.steps} steps x {args.groups} groups x {args.group_size} samples, "
              f"<= {args.max_tokens} tokens")
        results = [run_mode(args, model, scratch, mode) for mode in ("sync", "async")]
        keys = ("mode", "loop_s", "train_call_s", "trained_groups", "stale_dropped", "rollout_tok_s_per_gpu",
                "learner_util", "sync_s")
        print("  ".join(f"{k:>14}" for k in keys))
        for r in results:
            print("  ".join(f"{r[k]:>14.3f}" if isinstance(r[k], float) else f"{r[k]:>14}" for k in keys))
        print(f"sync / async loop time: {results[0]['loop_s'] / results[1]['loop_s']:.2f}x")
    ray.shutdown()


if __name__ == "__main__":
    main()
