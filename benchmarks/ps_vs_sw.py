"""Prefix Sliding against a plain sliding window on three variants of the arithmetic task: where Prefix Sliding's
advantage comes from the prefix, and where it does not (issue 41).

- **plain** (4 steps): one ``a+5=52`` line per step; the operations are only in the prompt. A sliding window of W
  loses them from one layer's view W tokens on, but an L-layer model reads L·(W - 1) positions back through its
  layers: at W = 24 and the recipe's 2 layers, 46, which still holds every operation of a 4-step prompt.
- **plain8** (8 steps): the same format; the last operations are written more than 46 positions after the prompt
  gave them (``tests/test_arith.py`` checks both reaches in tokens).
- **restated** (4 steps, ``task.restate=true``): each thinking line restates the running value and the operations
  left (``52 b-3 c+8 ___``), so what the next line needs is within one window.

Per seed S (all seeds at once, one process chain each; the two arms of a variant side by side)::

    sliderl sft configs/sft-tiny-arith.yaml task.num_steps=[N,N] task.restate=R kv=P sft.steps=2400 \\
        output_dir=OUT/sS/V-p model.seed=S learner.seed=S  # P in (prefix_sliding:24, sliding_window:24)
    sliderl eval OUT/sS/eval-V.yaml                       # per variant: each model under its own policy, and the
                                                          # prefix-sliding model under the sliding window

Every arm has the same SFT steps, batch and learning rate and the same problems (the variants of one length draw
identical prompts). The batch, learning rate and schedule are the recipe's; the steps (2400) were chosen on seed 9,
which is not reported: there the prefix-sliding arm of the hardest variant (restated) had 0.66 held-out exact
match at 1600 steps with its loss still falling, the plain one 1.00. The evaluation samples ``k`` completions of
the first ``--problems`` eval problems at temperature 0.6, top-p 0.95, with seed S. Writes ``OUT/rows.jsonl`` (one
row per seed, variant and entry), ``OUT/summary.md`` (mean ± sample SD over seeds) and ``OUT/ps_vs_sw.png``.

    OMP_NUM_THREADS=1 python benchmarks/ps_vs_sw.py --seeds 0 1 2 --out runs/ps-vs-sw      # ~60 min on 2 cores
    python benchmarks/ps_vs_sw.py --seeds 0 --out /tmp/psw --sft-steps 4 --problems 2 --k 1   # the smoke run
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.seed_chains import (
    ROOT,
    SLIDERL,
    add_chain_args,
    mean_sd,
    run,
    run_seeds,
    sft_command,
    side_by_side,
    write_summary,
)

# name: (task.restate, operations per problem, what it shows at W = 24 with the recipe's 2-layer model, whose
# receptive field is 2·(W - 1) = 46 positions: a sliding window loses the prompt from one layer's view after 24
# tokens, but a second layer still reads it through the first until 46)
VARIANTS = {"plain": (False, 4), "restated": (True, 4), "plain8": (False, 8)}
LABELS = {"plain": "plain, 4 steps\n(prompt within 2 layers' reach)",
          "restated": "restated, 4 steps\n(state in the window)",
          "plain8": "plain, 8 steps\n(last operations beyond reach)"}
MAX_TOKENS = 128  # the longest restated solution is 117 byte-level tokens (4 steps), the plain one 53


def policies(window: int) -> dict[str, str]:
    return {"ps": f"prefix_sliding:{window}", "sw": f"sliding_window:{window}"}


def entries(seed_dir: Path, variant: str, window: int) -> list[dict]:
    """Each model under the policy it was trained under, and the prefix-sliding model under the sliding window
    (the prefix taken away at inference only)."""
    pol = policies(window)
    return [{"label": "PS-trained, PS", "checkpoint": str(seed_dir / f"{variant}-ps" / "model"), "kv": pol["ps"]},
            {"label": "SW-trained, SW", "checkpoint": str(seed_dir / f"{variant}-sw" / "model"), "kv": pol["sw"]},
            {"label": "PS-trained, SW", "checkpoint": str(seed_dir / f"{variant}-ps" / "model"), "kv": pol["sw"]}]


def eval_config(seed_dir: Path, variant: str, seed: int, args: argparse.Namespace) -> Path:
    """``sliderl eval``'s comparison file for one variant of one seed."""
    cfg = yaml.safe_load((ROOT / "configs" / "sft-tiny-arith.yaml").read_text())
    restate, steps = VARIANTS[variant]
    task = {**cfg["task"], "num_steps": [steps, steps], "restate": restate, "train_size": 64,
            "eval_size": args.problems}
    out = {"task": task, "model": cfg["model"], "warmstart": {"enabled": False},
           "engine": {"num_blocks": 4096, "device": args.device}, "sampling": {"max_tokens": MAX_TOKENS},
           "eval": {"num_problems": args.problems,
                    "compare": {"k": args.k, "temperature": 0.6, "top_p": 0.95, "seeds": [seed],
                                "output_dir": str(seed_dir / f"eval-{variant}"),
                                "entries": entries(seed_dir, variant, args.window)}}}
    path = seed_dir / f"eval-{variant}.yaml"
    path.write_text(yaml.safe_dump(out, sort_keys=False))
    return path


def chain(seed: int, args: argparse.Namespace) -> dict:
    """The four SFT arms (two at a time), then one comparison per variant; seconds per stage."""
    d = args.out / f"s{seed}"
    d.mkdir(parents=True, exist_ok=True)
    config = ROOT / "configs" / "sft-tiny-arith.yaml"
    seconds = {}
    for variant in args.variants:
        restate, steps = VARIANTS[variant]
        arms = {f"{variant}-{name}": sft_command(config, d / f"{variant}-{name}", seed, args,
                                                 f"task.num_steps=[{steps},{steps}]", f"task.restate={str(restate).lower()}",
                                                 f"kv={spec}", f"sft.steps={args.sft_steps}",
                                                 f"sft.check_every={max(args.sft_steps // 6, 1)}")
                for name, spec in policies(args.window).items()}
        seconds.update(side_by_side({name: (cmd, d / f"{name}.log") for name, cmd in arms.items()}))
    for variant in args.variants:
        cmd = [*SLIDERL, "eval", str(eval_config(d, variant, seed, args)), *args.eval_overrides]
        seconds[f"eval-{variant}"] = run(cmd, d / f"eval-{variant}.log")
    return seconds


def read_rows(out: Path, seeds: list[int]) -> list[dict]:
    """One row per seed, variant and entry from each comparison's results.jsonl (the variants every seed has)."""
    rows = []
    for seed in seeds:
        for variant in [v for v in VARIANTS if all((out / f"s{s}" / f"eval-{v}" / "results.jsonl").is_file()
                                                   for s in seeds)]:
            for line in (out / f"s{seed}" / f"eval-{variant}" / "results.jsonl").read_text().splitlines():
                r = json.loads(line)
                rows.append({"seed": seed, "variant": variant, "label": r["label"], "kv": r["kv"],
                             "checkpoint": r["checkpoint"], "avg_at_k": r["avg_at_k"], "pass_at_k": r["pass_at_k"],
                             "mean_live_kv": r["mean_live_kv"], "peak_live_kv": r["peak_live_kv"],
                             "generated_tokens": r.get("generated_tokens")})
    return rows



def plot(stats: list[dict], path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8.5, 3.8), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    labels = list(dict.fromkeys(s["label"] for s in stats))
    variants = list(dict.fromkeys(s["variant"] for s in stats))
    width = 0.8 / len(labels)
    for i, label in enumerate(labels):
        mine = [s for s in stats if s["label"] == label]
        xs = [variants.index(s["variant"]) + (i - (len(labels) - 1) / 2) * width for s in mine]
        ax.bar(xs, [s["avg_at_k"] for s in mine], width, yerr=[s["avg_at_k_sd"] for s in mine], capsize=3,
               label=label, color=f"C{i}")
    ax.set_xticks(range(len(variants)), [LABELS[v] for v in variants], fontsize=8)
    ax.set(ylabel="avg@k (mean ± sample SD over seeds)", ylim=(0, 1.05),
           title="Prefix Sliding vs sliding window at the same W")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)


def summarize(out: Path, seeds: list[int], seconds: dict[int, dict]) -> str:
    rows = read_rows(out, seeds)
    (out / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    stats, body = [], ["| variant | entry | kv | avg@k | pass@k | mean live KV | per seed avg@k |",
                       "|---|---|---|---|---|---|---|"]
    for variant in dict.fromkeys(r["variant"] for r in rows):
        for label in dict.fromkeys(r["label"] for r in rows):
            mine = [r for r in rows if r["variant"] == variant and r["label"] == label]
            s = {"variant": variant, "label": label, "kv": mine[0]["kv"], "seeds": seeds}
            for m in ("avg_at_k", "pass_at_k", "mean_live_kv"):
                s[m], s[f"{m}_sd"] = mean_sd([r[m] for r in mine])
            s["per_seed"] = [r["avg_at_k"] for r in mine]
            stats.append(s)
            body.append(f"| {variant} | {label} | {s['kv']} | {s['avg_at_k']:.3f} ± {s['avg_at_k_sd']:.3f} | "
                        f"{s['pass_at_k']:.3f} ± {s['pass_at_k_sd']:.3f} | {s['mean_live_kv']:.1f} | "
                        f"{', '.join(f'{v:.3f}' for v in s['per_seed'])} |")
    plot(stats, out / "ps_vs_sw.png")
    return write_summary(out, "Prefix Sliding vs sliding window", "ps_vs_sw.py", seeds, seconds, body, stats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_chain_args(parser, out="runs/ps-vs-sw")
    parser.add_argument("--window", type=int, default=24, help="W of both policies")
    parser.add_argument("--sft-steps", type=int, default=2400, help="SFT steps of every arm")
    parser.add_argument("--variants", nargs="+", choices=tuple(VARIANTS), default=list(VARIANTS),
                        help="which task variants to train and evaluate (the summary reads every one under --out)")
    parser.add_argument("--problems", type=int, default=64, help="eval problems per variant")
    parser.add_argument("--k", type=int, default=4, help="samples per problem")
    args = parser.parse_args()
    if min(args.window, args.problems, args.k, args.sft_steps) < 1:
        parser.error(f"--window, --problems, --k and --sft-steps must be >= 1, got {args.window}, {args.problems}, "
                     f"{args.k}, {args.sft_steps}")
    args.out = args.out.resolve()
    run_seeds(args, chain, summarize)


if __name__ == "__main__":
    main()
