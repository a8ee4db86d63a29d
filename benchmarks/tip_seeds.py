"""TIP in miniature, end to end, once per seed: the recipes of docs/guide.md "Train a TIP model", run as a user runs them.

For every seed S (all seeds at once, one process chain each)::

    sliderl sft configs/tip-sft.yaml output_dir=OUT/sS/sft model.seed=S learner.seed=S            # stage 1
    sliderl sft configs/tip-sft.yaml kv=full data.task_solution=solution_dense output_dir=OUT/sS/dense ...  # Dense
    sliderl train configs/tip-grpo.yaml run_dir=OUT/sS/grpo model.type=hf model.path=OUT/sS/sft/model \\
        warmstart.enabled=false train.seed=S learner.seed=S                                         # stage 2
    sliderl eval OUT/sS/eval.yaml        # configs/tip-eval.yaml with this seed's checkpoints

(the two SFT stages run side by side; stage 2 starts from the stage-1 checkpoint rather than re-running
it as its warm start). Then one table over seeds (mean ± sd) of every entry of the comparison — avg@k,
pass@k, mean live KV, throughput, decode seconds — and each entry's ratios to Dense, in OUT/summary.md
and OUT/summary.jsonl, and the three Pareto plots over seeds (each point an entry's mean ± sd) in
OUT/over-seeds/. ``--device cuda`` puts every learner and engine on the GPU (one GPU is shared by
all chains); ``--sft/--train/--eval KEY=VALUE ...`` add settings to those commands.

    python benchmarks/tip_seeds.py --seeds 0                   # the CPU default (configs/tip-*.yaml): ~6 min, 2 cores
    python benchmarks/tip_seeds.py --recipe tip-gpu --seeds 0 1 2 --device cuda --out runs/tip-gpu-seeds
    python benchmarks/tip_seeds.py --seeds 0 --out /tmp/tip-smoke --grpo-steps 2 --sft sft.steps=20 \\
        --train train.groups_per_step=2 --eval eval.num_problems=4 eval.compare.k=2
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from sliderl.cluster.eval.comparison import EntryResult  # noqa: E402
from sliderl.cluster.eval.report import write_report  # noqa: E402
from sliderl.cluster.eval.evaluation import SampledEval  # noqa: E402
from sliderl.cluster.run.checkpoints import MARKER  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ("tip", "tip-gpu")  # configs/RECIPE-{sft,grpo,eval}.yaml: the CPU default, the GPU-scale variant
METRICS = ("avg_at_k", "pass_at_k", "mean_live_kv", "peak_live_kv", "tokens_per_second", "decode_seconds")


def run(cmd: list[str], log: Path, seconds: float | None = None) -> float:
    """Run one sliderl command (its output to ``log``); its wall seconds. A failure stops the chain. With
    ``seconds``, a command still running then is interrupted (SIGINT: the job shuts Ray down; its
    checkpoints stay) and counts as finished."""
    start = time.perf_counter()
    with open(log, "w") as out:
        out.write(" ".join(cmd) + "\n")
        out.flush()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
        try:
            code = proc.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            out.write(f"\n[tip_seeds: stopped after {seconds:.0f} s, as --grpo-seconds asks]\n")
            return time.perf_counter() - start
    if code != 0:
        raise RuntimeError(f"exit {code}: {' '.join(cmd)} (log: {log})")
    return time.perf_counter() - start


def latest_checkpoint(run_dir: Path) -> Path:
    """The last complete checkpoint stage 2 wrote (its name sorts by step; complete = its marker written)."""
    done = sorted(p for p in (run_dir / "checkpoints").glob("step_*") if (p / MARKER).is_file())
    if not done:
        raise RuntimeError(f"stage 2 wrote no checkpoint under {run_dir / 'checkpoints'}")
    return done[-1]


def device_args(device: str, train: bool) -> list[str]:
    if device == "cpu":
        return ["learner.device=cpu"] + (["engine.device=cpu"] if train else [])
    args = ["learner.device=cuda"]
    if train:  # every chain's Ray instance sees the one GPU; each actor takes a slice of it
        args += ["engine.device=cuda", "learner.num_gpus=0.2", "rollout.num_gpus=0.2"]
    return args


def recipe(name: str, stage: str) -> Path:
    return ROOT / "configs" / f"{name}-{stage}.yaml"


def eval_config(seed_dir: Path, seed: int, args: argparse.Namespace) -> Path:
    """The recipe's eval config with this seed's checkpoints (stage 2's last), output directory and sampling
    seed; the recipe's own checkpoint paths (runs/RECIPE-dense/model, ...) say which is which."""
    cfg = yaml.safe_load(recipe(args.recipe, "eval").read_text())
    runs = f"runs/{args.recipe}"
    where = {f"{runs}-dense/": seed_dir / "dense" / "model", f"{runs}-sft/": seed_dir / "sft" / "model",
             f"{runs}-grpo/": latest_checkpoint(seed_dir / "grpo")}  # stage 2: whichever step it reached
    for entry in cfg["eval"]["compare"]["entries"]:
        entry["checkpoint"] = str(next(path for prefix, path in where.items() if entry["checkpoint"].startswith(prefix)))
    cfg["eval"]["compare"].update(seeds=[seed], output_dir=str(seed_dir / "eval"))
    cfg.setdefault("engine", {})["device"] = args.device
    path = seed_dir / "eval.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def chain(seed: int, args: argparse.Namespace) -> dict:
    """Stage 1 and the Dense baseline side by side, then stage 2, then the comparison; seconds per stage."""
    d = args.out / f"s{seed}"
    d.mkdir(parents=True, exist_ok=True)
    sliderl = [sys.executable, "-m", "sliderl.cluster.cli"]
    common = [f"model.seed={seed}", f"learner.seed={seed}", *device_args(args.device, False), *args.sft_overrides]
    sft_config = str(recipe(args.recipe, "sft"))
    sft = sliderl + ["sft", sft_config, f"output_dir={d / 'sft'}", *common]
    dense = sliderl + ["sft", sft_config, "kv=full", "data.task_solution=solution_dense", f"output_dir={d / 'dense'}", *common]
    with ThreadPoolExecutor(2) as pool:
        stage1, baseline = pool.submit(run, sft, d / "sft.log"), pool.submit(run, dense, d / "dense.log")
        seconds = {"sft": stage1.result(), "dense": baseline.result()}
    train = sliderl + ["train", str(recipe(args.recipe, "grpo")), f"run_dir={d / 'grpo'}", "model.type=hf", f"model.path={d / 'sft' / 'model'}",
                       "warmstart.enabled=false", f"train.seed={seed}", f"learner.seed={seed}",
                       *([f"train.steps={args.grpo_steps}"] if args.grpo_steps else []), *device_args(args.device, True),
                       "monitor.include_dashboard=false",  # chains side by side: one fixed dashboard port each would collide
                       *args.train_overrides]
    seconds["grpo"] = run(train, d / "grpo.log", args.grpo_seconds)
    compare = sliderl + ["eval", str(eval_config(d, seed, args)), *args.eval_overrides]
    seconds["eval"] = run(compare, d / "eval.log")
    return seconds


def over_seeds(out: Path, seeds: list[int]) -> list[EntryResult]:
    """Each comparison entry with one run per seed (every seed's own checkpoints), as ``sliderl eval`` holds an
    entry sampled under several seeds: ``write_report`` then draws the table and the three Pareto plots with
    mean ± sd over the seeds."""
    rows: dict[str, list[dict]] = {}
    for seed in seeds:
        for line in (out / f"s{seed}" / "eval" / "results.jsonl").read_text().splitlines():
            row = json.loads(line)
            rows.setdefault(row["label"], []).append(row)
    results = []
    for label, per_seed in rows.items():
        runs = tuple(SampledEval(**{k: v for k, v in r["runs"][0].items() if k != "seed"}) for r in per_seed)
        first = per_seed[0]
        results.append(EntryResult(label, first["checkpoint"], first["kv"], runs, tuple(seeds), first["budget_of"],
                                   first["fraction"], first["budget"]))
    return results


def summarize(out: Path, seeds: list[int], seconds: dict[int, dict]) -> str:
    """Mean ± sd over seeds of every comparison entry, with ratios to Dense; writes summary.md/jsonl."""
    rows: dict[str, list[dict]] = {}
    for seed in seeds:
        for line in (out / f"s{seed}" / "eval" / "results.jsonl").read_text().splitlines():
            row = json.loads(line)
            rows.setdefault(row["label"], []).append(row)
    dense = rows["Dense"]
    lines = [f"# TIP in miniature over seeds {seeds} — `python benchmarks/tip_seeds.py {' '.join(sys.argv[1:])}`", "",
             "| entry | avg@k | pass@k | mean live KV | KV / Dense | tok/s | tok/s / Dense | decode s |",
             "|---|---|---|---|---|---|---|---|"]
    summary = []
    for label, runs in rows.items():
        stat = {m: (statistics.mean(r[m] for r in runs), statistics.pstdev(r[m] for r in runs)) for m in METRICS}
        kv_ratio = statistics.mean(r["mean_live_kv"] / d["mean_live_kv"] for r, d in zip(runs, dense))
        tps_ratio = statistics.mean(r["tokens_per_second"] / d["tokens_per_second"] for r, d in zip(runs, dense))
        summary.append({"label": label, "seeds": seeds, **{m: v[0] for m, v in stat.items()},
                        **{f"{m}_sd": v[1] for m, v in stat.items()}, "kv_over_dense": kv_ratio,
                        "tps_over_dense": tps_ratio, "per_seed": [r["avg_at_k"] for r in runs]})
        f = lambda m, p: f"{stat[m][0]:.{p}f} ± {stat[m][1]:.{p}f}"  # noqa: E731
        lines.append(f"| {label} | {f('avg_at_k', 3)} | {f('pass_at_k', 3)} | {f('mean_live_kv', 1)} | {kv_ratio:.2f} "
                     f"| {f('tokens_per_second', 0)} | {tps_ratio:.2f} | {f('decode_seconds', 1)} |")
    lines += ["", "seconds per stage: " + "; ".join(f"seed {s}: " + ", ".join(f"{k} {v:.0f}" for k, v in seconds[s].items())
                                                    for s in seeds)]
    (out / "summary.jsonl").write_text("".join(json.dumps(r) + "\n" for r in summary))
    write_report(over_seeds(out, seeds), out / "over-seeds")  # results.md/jsonl and pareto_*.png, mean ± sd
    text = "\n".join(lines) + "\n"
    (out / "summary.md").write_text(text)
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--recipe", choices=RECIPES, default="tip",
                        help="configs/RECIPE-{sft,grpo,eval}.yaml: tip (the CPU default) or tip-gpu (GPU scale)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--out", type=Path, default=Path("runs/tip-seeds"))
    parser.add_argument("--grpo-steps", type=int, default=None,
                        help="stage 2's steps (default: the recipe's train.steps; its last checkpoint is evaluated)")
    parser.add_argument("--grpo-seconds", type=float, default=None,
                        help="stop stage 2 after this many seconds and evaluate its last checkpoint (a time-boxed run)")
    for stage in ("sft", "train", "eval"):
        parser.add_argument(f"--{stage}", dest=f"{stage}_overrides", nargs="+", default=[], metavar="KEY=VALUE",
                            help=f"settings for every {stage} command (e.g. --sft sft.steps=900)")
    parser.add_argument("--report-only", action="store_true", help="redraw the summary and plots from --out")
    args = parser.parse_args()
    args.out = args.out.resolve()
    if args.report_only:
        print(summarize(args.out, args.seeds, {s: {} for s in args.seeds}))
        return
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    start = time.perf_counter()
    with ThreadPoolExecutor(len(args.seeds)) as pool:
        seconds = dict(zip(args.seeds, pool.map(lambda s: chain(s, args), args.seeds)))
    print(summarize(args.out, args.seeds, seconds))
    print(f"all seeds: {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
