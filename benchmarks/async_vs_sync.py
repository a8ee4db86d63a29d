"""Wall time of the same training work in sync and async mode, and weight-sync seconds per backend.

Part 1 runs ``cluster.run.driver.train`` twice on one local Ray instance with identical settings except
``train.mode``: a random-weight Qwen3-architecture model (``--hidden``/``--layers``), the arithmetic
task, GRPO with a length-dependent KV penalty so every step trains, ``--steps`` steps of
``--groups`` groups x ``--group-size`` samples of up to ``--max-tokens`` tokens. Reported: the
loop's wall seconds (first step to last, from metrics.jsonl, so actor start-up is excluded), the
whole ``train`` call, groups generated and dropped, mean learner-step seconds.

Part 2 times ``WeightSync.publish`` (learner -> every worker, applied between engine steps) for
each backend this machine has: object_store and broadcast over gloo on CPU; cuda_ipc and
broadcast over NCCL as well when a GPU exists. The model for it is ``--sync-hidden`` x
``--sync-layers``; ``--repeats`` publishes after one warm-up, median reported.

    python benchmarks/async_vs_sync.py                  # defaults: see --help
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
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

STOP_IDS = list(range(0, 256, 8))


def job_overrides(args, model_dir: Path, run_dir: Path, mode: str) -> list[str]:
    return [
        "warmstart.enabled=false", "model.type=hf", f"model.path={model_dir}", f"run_dir={run_dir}",
        "task.num_steps=[2,4]", "task.train_size=256", "eval.before=false", "eval.after=false",
        f"sampling.max_tokens={args.max_tokens}", f"sampling.stop_token_ids={json.dumps(STOP_IDS)}",
        "engine.kv=prefix_sliding:16", "engine.num_blocks=1024",
        "reward={correctness: 1.0, kv_penalty: {budget: 1, weight: 0.01}}",
        f"train.mode={mode}", f"train.steps={args.steps}", f"train.groups_per_step={args.groups}",
        f"rollout.group_size={args.group_size}", "rollout.num_workers=1", "rollout.num_cpus=1", "learner.num_cpus=1",
        "learner.lr=1e-3",
        "train.max_staleness=1", f"rollout.max_inflight_groups={args.groups}", "checkpoint.every=0",
        "monitor.wandb.mode=disabled", "monitor.include_dashboard=false", "monitor.plots=false",
    ]


def run_mode(args, model_dir: Path, scratch: Path, mode: str) -> dict:
    from sliderl.cluster.config.base import load_config
    from sliderl.cluster.config.train import TrainConfig
    from sliderl.cluster.run.driver import train

    run_dir = scratch / f"run-{mode}"
    cfg = load_config(TrainConfig, None, job_overrides(args, model_dir, run_dir, mode))
    start = time.perf_counter()
    result = train(cfg)
    total = time.perf_counter() - start
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # elapsed_s counts from the Monitor's start, after every actor is up: the loop alone
    return {"mode": mode, "loop_s": rows[-1]["elapsed_s"], "train_call_s": total, "steps": result.state.step,
            "trained_groups": len(result.state.ledger.trained), "stale_dropped": len(result.state.ledger.stale),
            "learner_step_s": statistics.mean(r["learner_step_seconds"] for r in rows), "version": result.state.version}


def sync_backends(num_gpus: int, workers: int) -> list[tuple[str, str, str]]:
    """(backend, broadcast backend, device) triples this machine can run."""
    out = [("object_store", "auto", "cpu"), ("broadcast", "gloo", "cpu")]
    if num_gpus:
        out += [("object_store", "auto", "cuda"), ("cuda_ipc", "auto", "cuda")]
    if num_gpus >= workers + 1:  # NCCL needs one GPU per rank
        out.append(("broadcast", "nccl", "cuda"))
    return out


def time_sync(args, model_dir: Path, backend: str, group: str, device: str) -> dict:
    """Median seconds of WeightSync.publish to ``args.sync_workers`` workers (after one warm-up)."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    from sliderl.cluster.actors.learner_group import make_learner
    from sliderl.cluster.actors.placement import make_queue
    from sliderl.cluster.actors.rollout_worker import make_worker
    from sliderl.cluster.actors.weight_sync import WeightSync
    from sliderl.cluster.config.base import load_config
    from sliderl.cluster.config.train import TrainConfig

    if device == "cpu":
        gpus = 0.0
    else:  # cuda_ipc (and object_store): all actors share one GPU; nccl: one GPU each
        gpus = 1.0 if group == "nccl" else 1.0 / (args.sync_workers + 1)
    cpus = 1.0 / (args.sync_workers + 1)
    cfg = load_config(TrainConfig, None, [
        "warmstart.enabled=false", "model.type=hf", f"model.path={model_dir}", f"weight_sync.backend={backend}",
        f"weight_sync.broadcast_backend={group}", f"learner.device={device}", f"engine.device={device}",
        f"learner.num_gpus={gpus}", f"rollout.num_gpus={gpus}", f"learner.num_cpus={cpus}",
        f"rollout.num_cpus={cpus}", f"rollout.num_workers={args.sync_workers}", "engine.num_blocks=64",
    ])
    bundles = [{"CPU": cpus, **({"GPU": gpus} if gpus else {})}] * (args.sync_workers + 1)
    pg = placement_group(bundles, strategy="PACK")
    ray.get(pg.ready())
    queue = make_queue(cfg)
    learner = make_learner(cfg, pg, str(model_dir))
    workers = {w: make_worker(cfg, pg, w, str(model_dir), 0, queue) for w in range(args.sync_workers)}
    try:
        ray.get([w.status.remote() for w in workers.values()] + [learner.version.remote()])
        sync = WeightSync(backend, group, device, timeout_s=600)
        seconds = [sync.publish(0, learner, workers).seconds for _ in range(args.repeats + 1)][1:]
    finally:
        learner.kill()
        for actor in [queue.actor, *workers.values()]:
            ray.kill(actor, no_restart=True)
        remove_placement_group(pg)
    return {"backend": backend if backend != "broadcast" else f"broadcast ({group})", "device": device,
            "median_s": statistics.median(seconds), "min_s": min(seconds), "max_s": max(seconds)}


def model_bytes(model_dir: Path) -> int:
    return sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--groups", type=int, default=4, help="groups per step")
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--hidden", type=int, default=256, help="hidden size of the trained model")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--sync-hidden", type=int, default=512, help="hidden size of the weight-sync model")
    parser.add_argument("--sync-layers", type=int, default=8)
    parser.add_argument("--sync-workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--skip-modes", action="store_true", help="only time weight sync")
    args = parser.parse_args(argv)

    import ray
    import torch

    from sliderl.core.tiny import make_tiny_model

    scratch = Path(tempfile.mkdtemp(prefix="sliderl-bench-"))
    model = make_tiny_model(scratch / "model", "qwen3", hidden_size=args.hidden, num_layers=args.layers,
                            num_heads=8, num_kv_heads=4, intermediate_size=4 * args.hidden)
    sync_model = make_tiny_model(scratch / "sync-model", "qwen3", hidden_size=args.sync_hidden,
                                 num_layers=args.sync_layers, num_heads=8, num_kv_heads=4,
                                 intermediate_size=4 * args.sync_hidden)
    from sliderl.cluster.actors.placement import start_local_ray

    num_gpus = torch.cuda.device_count()
    gpu = num_gpus > 0
    start_local_ray(num_cpus=2, num_gpus=num_gpus, include_dashboard=False, log_to_driver=False)
    print(f"# async_vs_sync  {time.strftime('%Y-%m-%d %H:%M')}  torch {torch.__version__}  ray {ray.__version__}  "
          f"gpu {torch.cuda.get_device_name() if gpu else 'none'}  cpus {os.cpu_count()}")
    if not args.skip_modes:
        print(f"\n## same work in both modes: {args.steps} steps x {args.groups} groups x {args.group_size} samples, "
              f"<= {args.max_tokens} tokens, qwen3 h{args.hidden} l{args.layers} ({model_bytes(model) / 2**20:.1f} MiB)")
        print(f"{'mode':<6} {'loop s':>8} {'train() s':>10} {'trained':>8} {'dropped':>8} {'learner step s':>15}")
        results = [run_mode(args, model, scratch, mode) for mode in ("sync", "async")]
        for r in results:
            print(f"{r['mode']:<6} {r['loop_s']:>8.2f} {r['train_call_s']:>10.2f} {r['trained_groups']:>8} "
                  f"{r['stale_dropped']:>8} {r['learner_step_s']:>15.3f}")
        print(f"async / sync loop time: {results[1]['loop_s'] / results[0]['loop_s']:.2f}")
    print(f"\n## weight sync: learner -> {args.sync_workers} workers, qwen3 h{args.sync_hidden} l{args.sync_layers} "
          f"({model_bytes(sync_model) / 2**20:.1f} MiB fp32), median of {args.repeats} after a warm-up")
    print(f"{'backend':<20} {'device':<6} {'median s':>9} {'min s':>8} {'max s':>8}")
    for backend, group, device in sync_backends(num_gpus, args.sync_workers):
        r = time_sync(args, sync_model, backend, group, device)
        print(f"{r['backend']:<20} {r['device']:<6} {r['median_s']:>9.3f} {r['min_s']:>8.3f} {r['max_s']:>8.3f}")
    ray.shutdown()


if __name__ == "__main__":
    main()
