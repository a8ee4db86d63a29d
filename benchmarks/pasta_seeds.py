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
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.seed_chains import (  # noqa: E402
    ROOT,
    add_chain_args,
    mean_sd,
    eval_command,
    read_results,
    run,
    run_seeds,
    sft_command,
    side_by_side,
    train_command,
    write_summary,
)

SFT, BONBON, EVAL = (ROOT / "configs" / f"pasta-{name}.yaml" for name in ("sft", "bonbon", "eval"))
ENTRIES = ("Baseline-SFT", "Pasta-SFT", "Pasta-BoNBoN")
METRICS = ("avg_at_k", "speedup", "generated_tokens")


def chain(seed: int, args: argparse.Namespace) -> dict:
    """Baseline-SFT and Pasta-SFT side by side, then BoNBoN, then the evaluation; seconds per stage."""
    d = args.out / f"s{seed}"
    d.mkdir(parents=True, exist_ok=True)
    base = sft_command(SFT, d / "base", seed, args, "kv=full", "data.task_solution=solution_plain")
    sft = sft_command(SFT, d / "sft", seed, args)
    if args.reuse_sft and all((d / name / "model").is_dir() for name in ("base", "sft")):
        seconds = {}  # stage 2 again on this seed's SFT checkpoints (e.g. other --train settings)
    else:
        seconds = side_by_side({"baseline_sft": (base, d / "base.log"), "pasta_sft": (sft, d / "sft.log")})
    train = train_command(BONBON, d / "bonbon", d / "sft" / "model", seed, args,
                          f"reward.speedup.baseline_model={d / 'base' / 'model'}", f"train.steps={args.bonbon_steps}",
                          "checkpoint.every=0")
    seconds["bonbon"] = run(train, d / "bonbon.log")
    where = {"Baseline-SFT": d / "base" / "model", "Pasta-SFT": d / "sft" / "model",
             "Pasta-BoNBoN": d / "bonbon" / "checkpoints" / f"step_{args.bonbon_steps:06d}"}
    seconds["eval"] = run(eval_command(EVAL, d, seed, args, lambda entry: where[entry["label"]]), d / "eval.log")
    return seconds



def summarize(out: Path, seeds: list[int], seconds: dict[int, dict]) -> str:
    """Mean ± sd over seeds of each entry's accuracy and speedup and the acceptance deltas; summary.md/jsonl."""
    rows = read_results(out, seeds)
    acc = {label: [r["avg_at_k"] for r in rows[label]] for label in ENTRIES}
    speed = {label: [r["speedup"] for r in rows[label]] for label in ENTRIES}
    fmt = lambda v, p: f"{v[0]:.{p}f} ± {v[1]:.{p}f}"  # noqa: E731
    body = ["| entry | held-out accuracy | geo-mean theoretical speedup | tokens per response |", "|---|---|---|---|"]
    summary = []
    for label in ENTRIES:
        tokens = [r["generated_tokens"] / r["num_problems"] / r["k"] for r in rows[label]]
        summary.append({"label": label, "seeds": seeds, "accuracy": mean_sd(acc[label])[0],
                        "accuracy_sd": mean_sd(acc[label])[1], "speedup": mean_sd(speed[label])[0],
                        "speedup_sd": mean_sd(speed[label])[1], "per_seed_accuracy": acc[label],
                        "per_seed_speedup": speed[label]})
        body.append(f"| {label} | {fmt(mean_sd(acc[label]), 3)} | {fmt(mean_sd(speed[label]), 3)} "
                    f"| {statistics.mean(tokens):.1f} |")
    deltas = {
        "Pasta-SFT − Baseline-SFT accuracy (points)": [100 * (p - b) for p, b in zip(acc["Pasta-SFT"], acc["Baseline-SFT"])],
        "Pasta-BoNBoN − Pasta-SFT accuracy (points)": [100 * (p - b) for p, b in zip(acc["Pasta-BoNBoN"], acc["Pasta-SFT"])],
        "Pasta-BoNBoN / Pasta-SFT speedup": [p / b for p, b in zip(speed["Pasta-BoNBoN"], speed["Pasta-SFT"])],
    }
    body += ["", "| acceptance delta | mean ± sd | per seed |", "|---|---|---|"]
    body += [f"| {name} | {fmt(mean_sd(v), 3)} | {', '.join(f'{x:.3f}' for x in v)} |" for name, v in deltas.items()]
    plot(out / "quality_vs_speedup.png", acc, speed)
    return write_summary(out, "Pasta in miniature", "pasta_seeds.py", seeds, seconds, body,
                         [*summary, {"deltas": deltas}])


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
    add_chain_args(parser, out="runs/pasta-seeds")
    parser.add_argument("--bonbon-steps", type=int, default=30, help="stage 2's steps (its last checkpoint is evaluated)")
    parser.add_argument("--reuse-sft", action="store_true", help="keep a seed's Baseline-SFT and Pasta-SFT checkpoints "
                        "where OUT/sS/{base,sft}/model exist (stage 2 and the evaluation run again; OUT/sS/bonbon must "
                        "not exist)")
    args = parser.parse_args()
    args.out = args.out.resolve()
    run_seeds(args, chain, summarize)


if __name__ == "__main__":
    main()
