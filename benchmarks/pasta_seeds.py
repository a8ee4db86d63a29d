"""Pasta in miniature, end to end, once per seed: the recipes of docs/guide.md "Train a Pasta model", run as a user runs them.

For every seed S (all seeds at once, one process chain each)::

    sliderl sft configs/pasta-sft.yaml kv=full data.task_solution=solution_plain output_dir=OUT/sS/base ...  # Baseline-SFT
    sliderl sft configs/pasta-sft.yaml output_dir=OUT/sS/sft model.seed=S learner.seed=S                   # Pasta-SFT
    sliderl train configs/pasta-bonbon.yaml run_dir=OUT/sS/bonbon model.type=hf model.path=OUT/sS/sft/model \\
        warmstart.enabled=false reward.speedup.baseline_model=OUT/sS/base/model train.seed=S learner.seed=S
    sliderl eval OUT/sS/eval.yaml        # configs/pasta-eval.yaml with this seed's checkpoints

(the two SFT stages run side by side; stage 2 starts from the Pasta-SFT checkpoint rather than re-running
it as its warm start). Then one table over seeds (mean ± sd) of each entry's held-out accuracy and
geometric-mean theoretical speedup over Baseline-SFT, the acceptance deltas (Pasta-SFT − Baseline-SFT
accuracy; Pasta-BoNBoN − Pasta-SFT accuracy and speedup), in OUT/summary.md and OUT/summary.jsonl, and
OUT/quality_vs_speedup.png (every seed's point, and each entry's mean ± sd). ``--device cuda`` puts every
learner and engine on the GPU (one GPU shared by all chains); ``--sft/--train/--eval KEY=VALUE ...`` add
settings to those commands.

    python benchmarks/pasta_seeds.py --seeds 0 1 2 --device cuda --out runs/pasta-seeds
    python benchmarks/pasta_seeds.py --seeds 0 --out /tmp/pasta-smoke --bonbon-steps 1 --sft sft.steps=4 \\
        --train train.groups_per_step=2 task.train_size=2 eval.before=false eval.after=false --eval eval.num_problems=4
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
SFT, BONBON, EVAL = (ROOT / "configs" / f"pasta-{name}.yaml" for name in ("sft", "bonbon", "eval"))
ENTRIES = ("Baseline-SFT", "Pasta-SFT", "Pasta-BoNBoN")
METRICS = ("avg_at_k", "speedup", "generated_tokens")


def run(cmd: list[str], log: Path) -> float:
    """Run one sliderl command (its output to ``log``); its wall seconds. A failure stops the chain."""
    start = time.perf_counter()
    with open(log, "w") as out:
        out.write(" ".join(cmd) + "\n")
        out.flush()
        code = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT).returncode
    if code != 0:
        raise RuntimeError(f"exit {code}: {' '.join(cmd)} (log: {log})")
    return time.perf_counter() - start


def device_args(device: str, train: bool) -> list[str]:
    if device == "cpu":
        return ["learner.device=cpu"] + (["engine.device=cpu"] if train else [])
    args = ["learner.device=cuda"]
    if train:  # every chain's Ray instance sees the one GPU; each actor takes a slice of it
        args += ["engine.device=cuda", "learner.num_gpus=0.2", "rollout.num_gpus=0.2"]
    return args


def eval_config(seed_dir: Path, seed: int, bonbon_steps: int, device: str) -> Path:
    """configs/pasta-eval.yaml with this seed's checkpoints, output directory and sampling seed."""
    cfg = yaml.safe_load(EVAL.read_text())
    where = {"Baseline-SFT": seed_dir / "base" / "model", "Pasta-SFT": seed_dir / "sft" / "model",
             "Pasta-BoNBoN": seed_dir / "bonbon" / "checkpoints" / f"step_{bonbon_steps:06d}"}
    for entry in cfg["eval"]["compare"]["entries"]:
        entry["checkpoint"] = str(where[entry["label"]])
    cfg["eval"]["compare"].update(seeds=[seed], output_dir=str(seed_dir / "eval"))
    cfg.setdefault("engine", {})["device"] = device
    path = seed_dir / "eval.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def chain(seed: int, args: argparse.Namespace) -> dict:
    """Baseline-SFT and Pasta-SFT side by side, then BoNBoN, then the evaluation; seconds per stage."""
    d = args.out / f"s{seed}"
    d.mkdir(parents=True, exist_ok=True)
    sliderl = [sys.executable, "-m", "sliderl.cluster.cli"]
    common = [f"model.seed={seed}", f"learner.seed={seed}", *device_args(args.device, False), *args.sft_overrides]
    base = sliderl + ["sft", str(SFT), "kv=full", "data.task_solution=solution_plain", f"output_dir={d / 'base'}",
                      *common]
    sft = sliderl + ["sft", str(SFT), f"output_dir={d / 'sft'}", *common]
    if args.reuse_sft and all((d / name / "model").is_dir() for name in ("base", "sft")):
        seconds = {}  # stage 2 again on this seed's SFT checkpoints (e.g. other --train settings)
    else:
        with ThreadPoolExecutor(2) as pool:
            baseline, stage1 = pool.submit(run, base, d / "base.log"), pool.submit(run, sft, d / "sft.log")
            seconds = {"baseline_sft": baseline.result(), "pasta_sft": stage1.result()}
    train = sliderl + ["train", str(BONBON), f"run_dir={d / 'bonbon'}", "model.type=hf",
                       f"model.path={d / 'sft' / 'model'}", "warmstart.enabled=false",
                       f"reward.speedup.baseline_model={d / 'base' / 'model'}", f"train.seed={seed}",
                       f"learner.seed={seed}", f"train.steps={args.bonbon_steps}", "checkpoint.every=0",
                       *device_args(args.device, True), "monitor.include_dashboard=false",  # seeds side by side
                       *args.train_overrides]
    seconds["bonbon"] = run(train, d / "bonbon.log")
    compare = sliderl + ["eval", str(eval_config(d, seed, args.bonbon_steps, args.device)), *args.eval_overrides]
    seconds["eval"] = run(compare, d / "eval.log")
    return seconds


def read_results(out: Path, seeds: list[int]) -> dict[str, list[dict]]:
    """label -> one results.jsonl row per seed."""
    rows: dict[str, list[dict]] = {}
    for seed in seeds:
        for line in (out / f"s{seed}" / "eval" / "results.jsonl").read_text().splitlines():
            row = json.loads(line)
            rows.setdefault(row["label"], []).append(row)
    return rows


def mean_sd(values: list[float]) -> tuple[float, float]:
    return statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def summarize(out: Path, seeds: list[int], seconds: dict[int, dict]) -> str:
    """Mean ± sd over seeds of each entry's accuracy and speedup and the acceptance deltas; summary.md/jsonl."""
    rows = read_results(out, seeds)
    acc = {label: [r["avg_at_k"] for r in rows[label]] for label in ENTRIES}
    speed = {label: [r["speedup"] for r in rows[label]] for label in ENTRIES}
    fmt = lambda v, p: f"{v[0]:.{p}f} ± {v[1]:.{p}f}"  # noqa: E731
    lines = [f"# Pasta in miniature over seeds {seeds} — `python benchmarks/pasta_seeds.py {' '.join(sys.argv[1:])}`",
             "", "| entry | held-out accuracy | geo-mean theoretical speedup | tokens per response |", "|---|---|---|---|"]
    summary = []
    for label in ENTRIES:
        tokens = [r["generated_tokens"] / r["num_problems"] / r["k"] for r in rows[label]]
        summary.append({"label": label, "seeds": seeds, "accuracy": mean_sd(acc[label])[0],
                        "accuracy_sd": mean_sd(acc[label])[1], "speedup": mean_sd(speed[label])[0],
                        "speedup_sd": mean_sd(speed[label])[1], "per_seed_accuracy": acc[label],
                        "per_seed_speedup": speed[label]})
        lines.append(f"| {label} | {fmt(mean_sd(acc[label]), 3)} | {fmt(mean_sd(speed[label]), 3)} "
                     f"| {statistics.mean(tokens):.1f} |")
    deltas = {
        "Pasta-SFT − Baseline-SFT accuracy (points)": [100 * (p - b) for p, b in zip(acc["Pasta-SFT"], acc["Baseline-SFT"])],
        "Pasta-BoNBoN − Pasta-SFT accuracy (points)": [100 * (p - b) for p, b in zip(acc["Pasta-BoNBoN"], acc["Pasta-SFT"])],
        "Pasta-BoNBoN / Pasta-SFT speedup": [p / b for p, b in zip(speed["Pasta-BoNBoN"], speed["Pasta-SFT"])],
    }
    lines += ["", "| acceptance delta | mean ± sd | per seed |", "|---|---|---|"]
    lines += [f"| {name} | {fmt(mean_sd(v), 3)} | {', '.join(f'{x:.3f}' for x in v)} |" for name, v in deltas.items()]
    lines += ["", "seconds per stage: " + "; ".join(f"seed {s}: " + ", ".join(f"{k} {v:.0f}" for k, v in seconds[s].items())
                                                    for s in seeds)]
    (out / "summary.jsonl").write_text("".join(json.dumps(r) + "\n" for r in summary)
                                       + json.dumps({"deltas": deltas}) + "\n")
    plot(out / "quality_vs_speedup.png", acc, speed)
    text = "\n".join(lines) + "\n"
    (out / "summary.md").write_text(text)
    return text


def plot(path: Path, acc: dict[str, list[float]], speed: dict[str, list[float]]) -> None:
    """Held-out accuracy against geometric-mean theoretical speedup: every seed faint, each entry's mean ± sd."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.5, 4.5), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for i, label in enumerate(ENTRIES):
        color = f"C{i}"
        ax.scatter(speed[label], acc[label], color=color, alpha=0.35, s=18)
        (sx, sdx), (ay, sdy) = mean_sd(speed[label]), mean_sd(acc[label])
        ax.errorbar([sx], [ay], xerr=[sdx], yerr=[sdy], fmt="o", color=color, capsize=3, label=label)
    ax.axvline(1.0, color="grey", lw=0.8, ls=":")
    ax.margins(x=0.2, y=0.15)
    ax.set(xlabel="geometric-mean theoretical speedup over Baseline-SFT", ylabel="held-out accuracy (greedy)",
           title=f"Pasta in miniature: quality against speedup ({len(next(iter(acc.values())))} seeds)")
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--out", type=Path, default=Path("runs/pasta-seeds"))
    parser.add_argument("--bonbon-steps", type=int, default=30, help="stage 2's steps (its last checkpoint is evaluated)")
    parser.add_argument("--reuse-sft", action="store_true", help="keep a seed's Baseline-SFT and Pasta-SFT checkpoints "
                        "where OUT/sS/{base,sft}/model exist (stage 2 and the evaluation run again; OUT/sS/bonbon must "
                        "not exist)")
    for stage in ("sft", "train", "eval"):
        parser.add_argument(f"--{stage}", dest=f"{stage}_overrides", nargs="+", default=[], metavar="KEY=VALUE",
                            help=f"settings for every {stage} command (e.g. --sft sft.steps=900)")
    args = parser.parse_args()
    args.out = args.out.resolve()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    start = time.perf_counter()
    with ThreadPoolExecutor(len(args.seeds)) as pool:
        seconds = dict(zip(args.seeds, pool.map(lambda s: chain(s, args), args.seeds)))
    print(summarize(args.out, args.seeds, seconds))
    print(f"all seeds: {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
