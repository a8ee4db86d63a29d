"""TIP in miniature, end to end, once per seed: the recipes of docs/guide.md "Train a TIP model", run as a user runs them.

For every seed S (all seeds at once, one process chain each)::

    sliderl sft configs/tip-sft.yaml output_dir=OUT/sS/sft model.seed=S learner.seed=S            # stage 1
    sliderl sft configs/tip-sft.yaml kv=full data.task_solution=solution_dense output_dir=OUT/sS/dense ...  # Dense
    sliderl train configs/tip-grpo.yaml run_dir=OUT/sS/grpo model.type=hf model.path=OUT/sS/sft/model \\
        warmstart.enabled=false train.seed=S learner.seed=S                                         # stage 2
    sliderl eval OUT/sS/eval.yaml        # configs/tip-eval.yaml with this seed's checkpoints

(the two SFT stages run side by side; stage 2 starts from the stage-1 checkpoint rather than re-running
it as its warm start). ``--dense-arms`` adds the two Dense arms a fair comparison needs (issue 41): **Dense-long**,
the Dense SFT at twice the recipe's SFT steps (more training than TIP's SFT + GRPO: 500 more steps of 16
demonstrations against GRPO's 25 steps of 64 rollouts), side by side with the other two, and **Dense-GRPO**, stage
2's recipe from the Dense checkpoint under ``engine.kv=full`` with the KV penalty removed (``reward.kv_penalty=null``:
the same RL stage and reward minus its KV term), side by side with stage 2; both are evaluated beside the rest,
with StreamingLLM and PH2O (on the Dense model) also at 100% of Dense's and of TIP's *peak* live KV. Then one
table over seeds (mean ± sd) of every entry of the comparison — avg@k,
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
import statistics
import sys
from pathlib import Path

import yaml

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
from sliderl.cluster.eval.comparison import EntryResult  # noqa: E402
from sliderl.cluster.eval.evaluation import SampledEval  # noqa: E402
from sliderl.cluster.eval.report import write_report  # noqa: E402
from sliderl.cluster.run.checkpoints import MARKER  # noqa: E402

RECIPES = ("tip", "tip-gpu")  # configs/RECIPE-{sft,grpo,eval}.yaml: the CPU default, the GPU-scale variant
METRICS = ("avg_at_k", "pass_at_k", "mean_live_kv", "peak_live_kv", "kv_token_steps", "tokens_per_second",
           "decode_seconds")


def latest_checkpoint(run_dir: Path) -> Path:
    """The last complete checkpoint stage 2 wrote (its name sorts by step; complete = its marker written)."""
    done = sorted(p for p in (run_dir / "checkpoints").glob("step_*") if (p / MARKER).is_file())
    if not done:
        raise RuntimeError(f"stage 2 wrote no checkpoint under {run_dir / 'checkpoints'}")
    return done[-1]


def recipe(name: str, stage: str) -> Path:
    return ROOT / "configs" / f"{name}-{stage}.yaml"


def compare_command(seed_dir: Path, seed: int, args: argparse.Namespace) -> list[str]:
    """The recipe's eval with this seed's checkpoints (stage 2's last); the recipe's own checkpoint paths
    (runs/RECIPE-dense/model, ...) say which is which."""
    runs = f"runs/{args.recipe}"
    where = {f"{runs}-dense/": seed_dir / "dense" / "model", f"{runs}-sft/": seed_dir / "sft" / "model",
             f"{runs}-grpo/": latest_checkpoint(seed_dir / "grpo")}  # stage 2: whichever step it reached
    template = recipe(args.recipe, "eval")
    if args.dense_arms:
        where |= {f"{runs}-dense-long/": seed_dir / "dense-long" / "model",
                  f"{runs}-dense-grpo/": latest_checkpoint(seed_dir / "dense-grpo")}
        cfg = yaml.safe_load(template.read_text())
        entries = cfg["eval"]["compare"]["entries"]
        entries[1:1] = [{"label": "Dense-long", "checkpoint": f"{runs}-dense-long/model", "kv": "full"},
                        {"label": "Dense-GRPO", "checkpoint": f"{runs}-dense-grpo/model", "kv": "full"}]
        for name, kv in (("StreamingLLM", "streaming:4:{budget-4}"), ("PH2O", "h2o:{budget}")):
            for of in ("Dense", "TIP"):  # the eviction baselines at Dense's peak and TIP's peak live KV
                entries.append({"label": f"{name}/{of}", "checkpoint": f"{runs}-dense/model", "kv": kv,
                                "budget_of": of, "budgets": [1.0], "budget_metric": "peak_live_kv"})
        template = seed_dir / "eval-template.yaml"
        template.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return eval_command(template, seed_dir, seed, args, lambda entry: next(
        path for prefix, path in where.items() if entry["checkpoint"].startswith(prefix)))


def sft_steps(args: argparse.Namespace) -> int:
    """The SFT steps of this run's recipe (``--sft sft.steps=N`` wins)."""
    given = [o.split("=", 1)[1] for o in args.sft_overrides if o.startswith("sft.steps=")]
    return int(given[-1]) if given else int(yaml.safe_load(recipe(args.recipe, "sft").read_text())["sft"]["steps"])


def finished(log: Path) -> bool:
    """Whether the stage logging to ``log`` completed: an SFT's model manifest or a run's summary.txt is written."""
    out = log.with_suffix("")
    return (out / "model" / "manifest.json").is_file() or (out / "summary.txt").is_file()


def todo(stages: dict[str, tuple[list[str], Path]], args: argparse.Namespace) -> dict[str, tuple[list[str], Path]]:
    """The stages to run: all of them, or with ``--keep-done`` those not finished in ``--out`` already."""
    return {k: v for k, v in stages.items() if not (args.keep_done and finished(v[1]))}


def chain(seed: int, args: argparse.Namespace) -> dict:
    """Stage 1 and the Dense baseline side by side, then stage 2, then the comparison; seconds per stage."""
    d = args.out / f"s{seed}"
    d.mkdir(parents=True, exist_ok=True)
    sft_config = recipe(args.recipe, "sft")
    sft = sft_command(sft_config, d / "sft", seed, args)
    dense_args = ("kv=full", "data.task_solution=solution_dense")
    stage1 = {"sft": (sft, d / "sft.log"), "dense": (sft_command(sft_config, d / "dense", seed, args, *dense_args),
                                                      d / "dense.log")}
    if args.dense_arms:  # its own steps after --sft's, so that they win over an sft.steps there
        long = sft_command(sft_config, d / "dense-long", seed, args, *dense_args) + [f"sft.steps={2 * sft_steps(args)}"]
        stage1["dense-long"] = (long, d / "dense-long.log")
    seconds = side_by_side(todo(stage1, args))
    steps = [f"train.steps={args.grpo_steps}"] if args.grpo_steps else []
    train = train_command(recipe(args.recipe, "grpo"), d / "grpo", d / "sft" / "model", seed, args, *steps)
    if args.dense_arms:
        dense_train = train_command(recipe(args.recipe, "grpo"), d / "dense-grpo", d / "dense" / "model", seed, args,
                                    *steps, "engine.kv=full", "reward.kv_penalty=null")
        seconds |= side_by_side(todo({"grpo": (train, d / "grpo.log"),
                                      "dense-grpo": (dense_train, d / "dense-grpo.log")}, args))
    elif todo({"grpo": (train, d / "grpo.log")}, args):
        seconds["grpo"] = run(train, d / "grpo.log", args.grpo_seconds, why="as --grpo-seconds asks")
    seconds["eval"] = run(compare_command(d, seed, args), d / "eval.log")
    return seconds


def over_seeds(rows: dict[str, list[dict]], seeds: list[int]) -> list[EntryResult]:
    """Each comparison entry with one run per seed (every seed's own checkpoints), as ``sliderl eval`` holds an
    entry sampled under several seeds: ``write_report`` then draws the table and the three Pareto plots with
    mean ± sd over the seeds."""
    results = []
    for label, per_seed in rows.items():
        runs = tuple(SampledEval(**{k: v for k, v in r["runs"][0].items() if k != "seed"}) for r in per_seed)
        first = per_seed[0]
        results.append(EntryResult(label, first["checkpoint"], first["kv"], runs, tuple(seeds), first["budget_of"],
                                   first["fraction"], first["budget"]))
    return results


def metric(row: dict, name: str) -> float:
    """An entry's value of ``name`` (its seed's run's where the entry row predates the column; 0 if neither has it)."""
    return row[name] if name in row else row["runs"][0].get(name, 0.0)


def summarize(out: Path, seeds: list[int], seconds: dict[int, dict]) -> str:
    """Mean ± sample sd over seeds of every comparison entry, with ratios to Dense; writes summary.md/jsonl."""
    rows = read_results(out, seeds)
    dense = rows["Dense"]
    body = [("| entry | avg@k | pass@k | mean live KV | KV / Dense | peak live KV | KV x steps | KV x steps / Dense "
             "| tok/s | tok/s / Dense | decode s |"), "|---" * 11 + "|"]
    summary = []
    for label, runs in rows.items():
        stat = {m: mean_sd([metric(r, m) for r in runs]) for m in METRICS}
        kv_ratio = statistics.mean(r["mean_live_kv"] / d["mean_live_kv"] for r, d in zip(runs, dense))
        steps_ratio = statistics.mean(metric(r, "kv_token_steps") / metric(d, "kv_token_steps")
                                      if metric(d, "kv_token_steps") else float("nan") for r, d in zip(runs, dense))
        tps_ratio = statistics.mean(r["tokens_per_second"] / d["tokens_per_second"] for r, d in zip(runs, dense))
        summary.append({"label": label, "seeds": seeds, **{m: v[0] for m, v in stat.items()},
                        **{f"{m}_sd": v[1] for m, v in stat.items()}, "kv_over_dense": kv_ratio,
                        "tps_over_dense": tps_ratio, "kv_steps_over_dense": steps_ratio,
                        "per_seed": [r["avg_at_k"] for r in runs]})
        f = lambda m, p: f"{stat[m][0]:.{p}f} ± {stat[m][1]:.{p}f}"  # noqa: E731
        body.append(f"| {label} | {f('avg_at_k', 3)} | {f('pass_at_k', 3)} | {f('mean_live_kv', 1)} | {kv_ratio:.2f} "
                    f"| {f('peak_live_kv', 0)} | {f('kv_token_steps', 0)} | {steps_ratio:.2f} "
                    f"| {f('tokens_per_second', 0)} | {tps_ratio:.2f} | {f('decode_seconds', 1)} |")
    write_report(over_seeds(rows, seeds), out / "over-seeds")  # results.md/jsonl and pareto_*.png, mean ± sd
    return write_summary(out, "TIP in miniature", "tip_seeds.py", seeds, seconds, body, summary)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_chain_args(parser, out="runs/tip-seeds")
    parser.add_argument("--recipe", choices=RECIPES, default="tip",
                        help="configs/RECIPE-{sft,grpo,eval}.yaml: tip (the CPU default) or tip-gpu (GPU scale)")
    parser.add_argument("--grpo-steps", type=int, default=None,
                        help="stage 2's steps (default: the recipe's train.steps; its last checkpoint is evaluated)")
    parser.add_argument("--dense-arms", action="store_true",
                        help="add Dense-long (2x the SFT steps) and Dense-GRPO (stage 2 under kv=full, no KV penalty)")
    parser.add_argument("--keep-done", action="store_true",
                        help="do not run again a stage whose output in --out is complete (e.g. to add --dense-arms)")
    parser.add_argument("--grpo-seconds", type=float, default=None,
                        help="stop stage 2 after this many seconds and evaluate its last checkpoint (a time-boxed run)")
    args = parser.parse_args()
    if args.dense_arms and args.grpo_seconds is not None:
        parser.error("--grpo-seconds time-boxes stage 2 run alone; with --dense-arms stage 2 runs beside Dense-GRPO "
                     "untimed: use --grpo-steps instead")
    args.out = args.out.resolve()
    run_seeds(args, chain, summarize)


if __name__ == "__main__":
    main()
