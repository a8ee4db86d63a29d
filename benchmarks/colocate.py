"""Time per RL step of a recipe on real-size models, and on one GPU: keep the engine's KV pool, release it, or go async.

    python benchmarks/colocate.py --model DIR [--data FILE] [--config configs/qwen3-math-1gpu.yaml] \
        [--modes keep release async] [--kv prefix_sliding:1024 full] [--steps 3] [--warmup 1] [--groups 4] \
        [--group-size 8] [--max-tokens 1024] [--keep-kv-gb 40] [--release-kv-gb 40] [--out DIR]
    python benchmarks/colocate.py --config configs/qwen3-math-ngpu.yaml --modes as-is ...   # N GPUs
    python benchmarks/colocate.py --cpu-smoke --out DIR        # a tiny model on the CPU: checks the script

Each run is ``sliderl train CONFIG`` with the benchmark's overrides (the model, the data, the step's
size, ``warmstart``/eval off, no checkpoint), in a child process of its own (``--run``) under
``--run-timeout-s``; the learner takes ``--warmup + --steps`` steps and the run stops after the last
without writing a checkpoint. The modes, on the 1-GPU recipe (learner and one engine on one GPU):

  keep     sync (generate a step's groups, train, sync the weights): the engine's pool stays allocated,
           ``engine.kv_cache_gb = --keep-kv-gb`` (sized to leave the learner room);
  release  sync, ``rollout.release_between_steps``: the pool (``--release-kv-gb``) and the CUDA graphs are
           freed before each learner step and allocated and captured again after the weight sync;
  async    the pool kept, ``train.mode=async`` with ``train.max_staleness=2`` and 2 x ``--groups`` in flight
           (the engine generates the next steps' groups while the learner trains; ``engine.max_num_seqs`` holds
           them all): the 1-GPU recipe's own mode;
  as-is    the config's own placement, mode and pool (e.g. the N-GPU recipe); the groups in flight and queued
           scale with ``--groups`` as the config has them per group of a step (the N-GPU recipe's 32 in flight at
           16 per step: 8 in flight at ``--groups 4``).

The model has random weights (``benchmarks/make_checkpoint.py``: the Qwen3 config, a byte tokenizer
with a chat template, ``--stop-ids`` extra end ids so lengths vary), so the reward adds a KV penalty to
correctness (never 1 for random weights): groups then have reward variance and every step trains.
Per run, over the steps after ``--warmup`` (the first pays compilation and graph capture), median:

  step_s        wall seconds from one step's report to the next (metrics.jsonl ``elapsed_s``); step_mean_s
                their mean (async runs alternate short and long steps: the mean is their pace, the median not);
  pace_s        async: the mean tokens of a timed step / the rollout rate (below), the step time that generation
                sustains (a few timed steps open with groups generated before them, so their mean reads short);
                sync: step_mean_s
  learner_s     the learner step; sync_s the weight sync; release_s freeing + re-allocating the pool
  gen_s         step_s - learner_s - sync_s - release_s (sync mode: generation and the driver's share; async: none)
  rollout tok/s generated tokens of the step / gen_s, per rollout GPU (async: every group that arrived in the
                timed steps, dropped ones too, / their seconds: metrics' rollout_tokens_per_s x each step's seconds)
  stale_dropped groups dropped as too stale over the timed steps (async; their tokens were generated for nothing)
  learner tok/s trained (loss) tokens / learner_s;  learner in/s: tokens fed to the model / learner_s
  gpu%          mean utilisation of each GPU over the timed steps (nvidia-smi, sampled every 0.5 s)
  role busy%    per role (rollout workers, learner), the SM utilisation of its processes over the timed steps
                (nvidia-smi pmon, benchmarks/pmon.py), in % of one GPU: on one GPU, each role's share of it
  peak GiB      most memory in use on each GPU during the run (nvidia-smi)

Results: ``OUT/results.jsonl`` (one row per run, every step's metrics inside), ``OUT/logs.tar.gz`` (each
run's log, GPU samples and metrics.jsonl) and the table printed; the runs themselves (and a model built
here) stay in ``--work``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from benchmarks.pmon import ProcessSampler, busy_seconds  # noqa: E402

DATA_CANDIDATES = (ROOT / "shared/data/math500-dev.jsonl", ROOT.parent / "shared/data/math500-dev.jsonl")
MODES = ("keep", "release", "async", "as-is")
ASYNC_STALENESS = 2  # the async mode's train.max_staleness: 2 x groups_per_step in flight arrive ~2 versions old


def default_data() -> Path | None:
    """The project's MATH-500 sample: ``shared/data`` in the repository (as the GPU machine carries it) or beside it."""
    return next((p for p in DATA_CANDIDATES if p.is_file()), None)


def in_flight(args, mode: str) -> tuple[int, int]:
    """Groups a run's worker keeps in flight and its queue holds: sync modes one step's worth (and two queued),
    ``async`` ASYNC_STALENESS steps' worth, ``as-is`` the config's own per group of a step (``args.per_step``)."""
    if mode == "async":
        return ASYNC_STALENESS * args.groups, ASYNC_STALENESS * args.groups
    if mode == "as-is":
        per_step_inflight, per_step_queued = args.per_step
        inflight = max(1, round(per_step_inflight * args.groups))
        return inflight, max(inflight, round(per_step_queued * args.groups))
    return args.groups, 2 * args.groups


def overrides(args, mode: str, kv: str, run_dir: Path) -> list[str]:
    """The ``key=value`` overrides of one run of the recipe."""
    inflight, queued = in_flight(args, mode)
    out = [
        "model.type=hf", f"model.path={args.model}", f"data.source={args.data}", f"run_dir={run_dir}",
        "warmstart.enabled=false", "eval.before=false", "eval.after=false", "checkpoint.every=0",
        f"train.steps={args.warmup + args.steps + 1}", f"train.groups_per_step={args.groups}",
        f"rollout.group_size={args.group_size}", f"rollout.max_inflight_groups={inflight}",
        f"rollout.queue_size={queued}", f"engine.kv={kv}", f"engine.max_num_seqs={max(inflight * args.group_size, 8)}",
        f"sampling.max_tokens={args.max_tokens}", f"sampling.max_thinking_tokens={max(1, args.max_tokens - 128)}",
        f"reward={{correctness: 1.0, kv_penalty: {{budget: {args.kv_budget}, weight: 1.0}}}}",
        "monitor.wandb.mode=disabled", "monitor.plots=false", "monitor.include_dashboard=false",
    ]
    if mode in ("keep", "release"):
        out += ["train.mode=sync", f"rollout.release_between_steps={str(mode == 'release').lower()}",
                f"engine.kv_cache_gb={args.release_kv_gb if mode == 'release' else args.keep_kv_gb}"]
    elif mode == "async":
        out += ["train.mode=async", f"train.max_staleness={ASYNC_STALENESS}", "rollout.release_between_steps=false",
                f"engine.kv_cache_gb={args.keep_kv_gb}"]
    if args.cpu_smoke:
        out += ["engine.device=cpu", "engine.dtype=float32", "learner.device=cpu", "learner.dtype=float32",
                "rollout.num_gpus=0", "learner.num_gpus=0", "rollout.num_cpus=0.5", "learner.num_cpus=1",
                "weight_sync.backend=object_store", "ray.num_cpus=2", "engine.max_model_len=512",
                "learner.micro_batch_tokens=4096", "learner.gradient_checkpointing=false"]
    return out + list(args.set)


# ------------------------------------------------------------------------------ one run (child)


def run_child(spec_path: Path) -> None:
    """``--run SPEC``: one ``sliderl train`` in this process; writes the actors' pids and the result to SPEC's ``out``."""
    from sliderl.cluster.config.base import load_config
    from sliderl.cluster.config.train import TrainConfig
    from sliderl.cluster.run.driver import train

    spec = json.loads(spec_path.read_text())
    cfg = load_config(TrainConfig, spec["config"], spec["overrides"])
    seen: dict = {"pids": {}, "step_times": []}

    def hook(session, step: int, report) -> bool:
        import ray

        seen["step_times"].append(time.time())
        if not seen["pids"]:
            seen["pids"] = {"rollout": sorted(session.pool.pids.values()),
                            "learner": [ray.get(session.learner.pid.remote())]}
            seen["role_gpus"] = role_gpus(seen["pids"])
        Path(spec["out"]).write_text(json.dumps(seen))
        return step < cfg.train.steps - 1  # stop before the last step: its checkpoint is not part of the benchmark

    train(cfg, on_step=hook)


# ---------------------------------------------------------------------------- GPU sampling


def role_gpus(pids: dict[str, list[int]]) -> dict[str, list[str]]:
    """Which GPUs (nvidia-smi index) each role's processes use, and their MiB, as nvidia-smi lists them; {} when it
    cannot tell (no nvidia-smi, or process ids of another namespace)."""
    def query(*fields: str) -> list[list[str]]:
        try:
            text = subprocess.run(["nvidia-smi", f"--query-{fields[0]}={','.join(fields[1:])}",
                                   "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=30).stdout
        except (FileNotFoundError, subprocess.TimeoutExpired):
            return []
        return [[c.strip() for c in line.split(",")] for line in text.splitlines() if line.strip()]

    index = {bus: i for i, bus in query("gpu", "index", "pci.bus_id")}
    apps = {int(pid): (index.get(bus, bus), mib) for pid, bus, mib in query("compute-apps", "pid", "gpu_bus_id", "used_memory")}
    return {role: [f"gpu {apps[pid][0]}: {apps[pid][1]} MiB" for pid in ids if pid in apps] for role, ids in pids.items()}



class GpuSampler:
    """``nvidia-smi`` utilisation and memory of every GPU every 0.5 s, into a file (nothing without nvidia-smi)."""

    def __init__(self, path: Path):
        self.path, self.proc = path, None
        query = ["nvidia-smi", "--query-gpu=timestamp,index,utilization.gpu,memory.used", "--format=csv,noheader,nounits",
                 "-lms", "500"]
        try:
            self.proc = subprocess.Popen(query, stdout=path.open("w"), stderr=subprocess.DEVNULL)
        except FileNotFoundError:
            pass

    def stop(self) -> list[tuple[float, int, float, float]]:
        """(unix time, gpu index, utilisation %, MiB used) samples."""
        if self.proc is None:
            return []
        self.proc.terminate()
        self.proc.wait(timeout=10)
        rows = []
        for line in self.path.read_text().splitlines():
            parts = [p.strip() for p in line.split(",")]
            try:
                stamp = time.mktime(time.strptime(parts[0].split(".")[0], "%Y/%m/%d %H:%M:%S"))
                rows.append((stamp, int(parts[1]), float(parts[2]), float(parts[3])))
            except (ValueError, IndexError):
                continue
        return rows


def gpu_summary(samples, since: float | None) -> dict[str, dict[str, float]]:
    """Per GPU: mean utilisation over the samples from ``since`` on, and the peak memory over all."""
    out: dict[str, dict[str, float]] = {}
    for gpu in sorted({s[1] for s in samples}):
        mine = [s for s in samples if s[1] == gpu]
        timed = [s[2] for s in mine if since is None or s[0] >= since] or [s[2] for s in mine]
        out[str(gpu)] = {"util_pct": statistics.mean(timed), "peak_gib": max(s[3] for s in mine) / 1024}
    return out


# --------------------------------------------------------------------------------- one run (parent)


def run_one(args, mode: str, kv: str) -> dict:
    train_mode = next((o.split("=", 1)[1] for o in args.set if o.startswith("train.mode=")), None)
    name = f"{mode}+{train_mode}:{kv}" if train_mode else f"{mode}:{kv}"  # --set train.mode=async: keep+async:...
    run_dir = args.work / f"run-{mode}-{kv.replace(':', '')}"
    spec = {"config": str(args.config), "overrides": overrides(args, mode, kv, run_dir),
            "out": str(args.work / f"{run_dir.name}.child.json")}
    spec_path = args.work / f"{run_dir.name}.spec.json"
    spec_path.write_text(json.dumps(spec, indent=1))
    sampler, per_process = GpuSampler(args.work / f"{run_dir.name}.gpu.csv"), ProcessSampler()
    started = time.time()
    with (args.work / f"{run_dir.name}.log").open("w") as log:
        child = subprocess.Popen([sys.executable, __file__, "--run", str(spec_path)], stdout=log, stderr=subprocess.STDOUT,
                                 start_new_session=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                     [str(ROOT), os.environ.get("PYTHONPATH", "")])})
        status = wait(child, args.run_timeout_s)
    samples, process_samples = sampler.stop(), per_process.stop()
    row = {"run": name, "mode": mode, "kv": kv, "status": status, "wall_s": time.time() - started,
           "overrides": spec["overrides"]}
    metrics_file = run_dir / "metrics.jsonl"
    steps = [json.loads(line) for line in metrics_file.read_text().splitlines()] if metrics_file.is_file() else []
    steps = [s for s in steps if "learner_step_seconds" in s]
    row.update(step_numbers(args, steps, args.sync[mode, kv]))
    child_out = Path(spec["out"])
    seen = json.loads(child_out.read_text()) if child_out.is_file() else {"pids": {}, "step_times": []}
    times = seen["step_times"]
    row["gpus"] = gpu_summary(samples, times[args.warmup - 1] if len(times) > args.warmup else None) if samples else {}
    row["pids"], row["role_gpus"], row["steps"] = seen["pids"], seen.get("role_gpus", {}), steps
    row["role_util"] = role_util(process_samples, seen["pids"], times, args.warmup)
    return row


def role_util(samples, pids: dict[str, list[int]], times: list[float], warmup: int) -> dict[str, dict[str, float]]:
    """Per role, over the timed steps (from the report of step ``warmup`` to the last): the seconds its processes
    kept a GPU busy (``benchmarks/pmon.py``) and ``util_pct`` = 100 x busy / the window's seconds, in units of one
    GPU (two GPUs kept busy read 200). On one GPU this is what separates the engine's share from the learner's;
    {} without samples of those processes or without a timed step."""
    if len(times) <= warmup or times[-1] <= times[warmup - 1]:
        return {}
    role_of = {pid: role for role, ids in pids.items() for pid in ids}
    window = times[-1] - times[warmup - 1]
    busy = busy_seconds(samples, role_of.get, since=times[warmup - 1], until=times[-1])
    return {role: {"busy_s": b, "util_pct": 100 * b / window} for role, b in busy.items()}


def wait(child: subprocess.Popen, timeout_s: float) -> str:
    """ok, failed (exit code) or timeout; a child past its time gets SIGINT (Ray shuts down), then SIGKILL."""
    try:
        code = child.wait(timeout=timeout_s)
        return "ok" if code == 0 else f"failed ({code})"
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGINT)
        try:
            child.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
        return "timeout"


def step_numbers(args, steps: list[dict], sync_mode: bool) -> dict:
    """The medians of the module docstring over the steps after the warm-up; ``sync_mode``: the run's train.mode is sync."""
    if len(steps) <= args.warmup:
        return {"timed_steps": 0}
    times = [b["elapsed_s"] - a["elapsed_s"] for a, b in zip(steps, steps[1:])]
    timed = list(zip(steps[args.warmup:], times[args.warmup - 1:]))
    med = lambda f: statistics.median(f(s, t) for s, t in timed)  # noqa: E731
    learner = med(lambda s, t: s["learner_step_seconds"])
    sync = med(lambda s, t: s.get("weight_sync_seconds", 0.0))
    release = med(lambda s, t: s.get("memory_release_seconds", 0.0))
    step = med(lambda s, t: t)
    gen = step - learner - sync - release
    tokens = med(lambda s, t: s["completion_tokens"] * args.groups * args.group_size)
    if sync_mode:
        rollout = tokens / max(gen, 1e-9)
    else:  # a report's rollout_tokens_per_s: the tokens that arrived since the previous report, per second
        rollout = sum(s["rollout_tokens_per_s"] * t for s, t in timed) / sum(t for _, t in timed)
    step_mean = statistics.mean(t for _, t in timed)
    # async: a window opens with groups already generated, so its mean step reads short; the pace the generation
    # rate sustains is a step's tokens over the rate at which tokens arrived (sync: the mean step itself)
    pace = step_mean if sync_mode else statistics.mean(
        s["completion_tokens"] * args.groups * args.group_size for s, _ in timed) / max(rollout, 1e-9)
    return {"timed_steps": len(timed), "step_s": step, "step_mean_s": step_mean, "pace_s": pace,
            "gen_s": gen if sync_mode else None,
            "stale_dropped": sum(s.get("stale_groups_dropped", 0) for s, _ in timed),
            "learner_s": learner, "sync_s": sync,
            "release_s": release, "tokens_per_step": tokens, "rollout_tok_s_per_gpu": rollout / args.rollout_gpus,
            "learner_tok_s": med(lambda s, t: s.get("learner/num_loss_tokens", 0.0) / s["learner_step_seconds"]),
            "learner_in_s": med(lambda s, t: s.get("learner/num_tokens", 0.0) / s["learner_step_seconds"]),
            "mean_completion": med(lambda s, t: s["completion_tokens"]), "reward": med(lambda s, t: s["reward"])}


def table(rows: list[dict]) -> str:
    cols = ("run", "status", "step_s", "step_mean_s", "pace_s", "gen_s", "learner_s", "sync_s", "release_s", "rollout_tok_s_per_gpu",
            "learner_tok_s", "learner_in_s", "tokens_per_step")
    lines = ["  ".join(f"{c:>14}" if i else f"{c:<30}" for i, c in enumerate(cols)) + "  gpu: util% / peak GiB"]
    for r in rows:
        cells = [f"{r[c]:>14.2f}" if isinstance(r.get(c), float) else f"{'-' if r.get(c) is None else r[c]:>14}"
                 for c in cols[1:]]  # None: not measured in this mode (gen_s of an async run)
        gpus = " ".join(f"{g}: {v['util_pct']:.0f}% / {v['peak_gib']:.1f}" for g, v in r.get("gpus", {}).items())
        roles = "; ".join(f"{role} {', '.join(at)}" for role, at in r.get("role_gpus", {}).items() if at)
        roles += "".join(f"; {role} {u['util_pct']:.0f}% busy" for role, u in r.get("role_util", {}).items())
        lines.append(f"{r['run']:<30}  " + "  ".join(cells) + f"  {gpus}" + (f"  ({roles})" if roles else ""))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--model", type=Path, help="HF checkpoint (default: build one with make_checkpoint.py)")
    parser.add_argument("--size", default="1.7b", help="make_checkpoint --size when --model is not given")
    parser.add_argument("--stop-ids", type=int, default=150, help="make_checkpoint --stop-ids when building the model")
    parser.add_argument("--data", type=Path, default=None, help="MATH-format JSONL (default: ../shared/data/math500-dev.jsonl)")
    parser.add_argument("--config", type=Path, default=ROOT / "configs/qwen3-math-1gpu.yaml")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=["keep", "release"])
    parser.add_argument("--kv", nargs="+", default=["prefix_sliding:1024"])
    parser.add_argument("--steps", type=int, default=3, help="timed learner steps")
    parser.add_argument("--warmup", type=int, default=1, help="learner steps before the timed ones")
    parser.add_argument("--groups", type=int, default=4, help="groups per step")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=1024)
    parser.add_argument("--kv-budget", type=int, default=256, help="the KV penalty's budget (tokens)")
    parser.add_argument("--keep-kv-gb", type=float, default=40.0)
    parser.add_argument("--release-kv-gb", type=float, default=40.0)
    parser.add_argument("--set", nargs="*", default=[], help="more key=value overrides for every run")
    parser.add_argument("--run-timeout-s", type=float, default=280.0)
    parser.add_argument("--out", type=Path, default=Path("runs/colocate"), help="results.jsonl and logs.tar.gz")
    parser.add_argument("--work", type=Path, help="runs, logs and a built model (default: a new folder in /tmp)")
    parser.add_argument("--cpu-smoke", action="store_true")
    args = parser.parse_args(argv)
    if args.run is not None:
        return run_child(args.run)
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    args.work = (args.work or Path(tempfile.mkdtemp(prefix="sliderl-colocate-"))).resolve()
    args.work.mkdir(parents=True, exist_ok=True)
    if args.cpu_smoke:  # a pool the CPU can hold
        args.keep_kv_gb = args.release_kv_gb = 0.05
    prepare_inputs(args)
    from sliderl.cluster.config.base import load_config
    from sliderl.cluster.config.train import TrainConfig

    base = load_config(TrainConfig, str(args.config), [f"model.path={args.model}", *args.set])
    args.per_step = (base.rollout.max_inflight_groups / base.train.groups_per_step,
                     base.rollout.queue_size / base.train.groups_per_step)
    args.sync = {}  # every run's config checked before the first starts: (mode, kv) -> its train.mode is sync
    for kv in args.kv:
        for mode in args.modes:
            cfg = load_config(TrainConfig, str(args.config), overrides(args, mode, kv, args.work / "check"))
            args.sync[mode, kv] = cfg.train.mode == "sync"
    args.rollout_gpus = max(1.0, base.rollout.num_workers * base.rollout.num_gpus)
    print(f"# colocate {time.strftime('%Y-%m-%d %H:%M')} config {args.config.name} model {args.model} data "
          f"{args.data.name}; {args.groups} groups x {args.group_size} per step, <= {args.max_tokens} tokens, "
          f"{args.warmup} warm-up + {args.steps} timed steps", flush=True)
    rows = []
    with (args.out / "results.jsonl").open("w") as results:
        for kv in args.kv:
            for mode in args.modes:
                rows.append(run_one(args, mode, kv))
                results.write(json.dumps(rows[-1]) + "\n")
                results.flush()
                print(table(rows[-1:]).splitlines()[-1], flush=True)
    pack_logs(args.work, args.out / "logs.tar.gz")
    print("\n" + table(rows))
    for kv in args.kv:
        by_mode = {r["mode"]: r for r in rows if r["kv"] == kv and "step_s" in r}
        if "keep" in by_mode and "release" in by_mode:
            print(f"{kv}: release / keep step time = {by_mode['release']['step_s'] / by_mode['keep']['step_s']:.2f}x")
        if "keep" in by_mode and "async" in by_mode:  # by the pace: async steps alternate short and long
            print(f"{kv}: async / keep step time = {by_mode['async']['pace_s'] / by_mode['keep']['pace_s']:.2f}x by the pace, "
                  f"{by_mode['async']['step_mean_s'] / by_mode['keep']['step_mean_s']:.2f}x by the mean step")


def pack_logs(work: Path, archive: Path) -> None:
    """The runs' logs, GPU samples, specs and metrics (no traces, no model) in one archive: few files come back
    from a GPU machine."""
    with tarfile.open(archive, "w:gz") as tar:
        for path in sorted(work.glob("*.log")) + sorted(work.glob("*.gpu.csv")) + sorted(work.glob("*.json")) \
                + sorted(work.glob("run-*/metrics.jsonl")):
            tar.add(path, arcname=str(path.relative_to(work)))


def prepare_inputs(args) -> None:
    """The data file and the model (built here when not given)."""
    args.data = args.data or default_data()
    if args.data is None or not args.data.is_file():
        raise SystemExit(f"no data file: pass --data (looked for {', '.join(map(str, DATA_CANDIDATES))})")
    args.data = args.data.resolve()
    if args.model is None:
        from benchmarks.make_checkpoint import make_checkpoint

        size = "tiny" if args.cpu_smoke else args.size
        args.model = make_checkpoint(args.work / f"model-{size}", size, 8 if args.cpu_smoke else args.stop_ids)
    args.model = args.model.resolve()


if __name__ == "__main__":
    main()
