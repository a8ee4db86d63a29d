"""TIP vs Dense with checkpoints picked on a validation slice (issue 41), over a finished ``tip_seeds.py --dense-arms``
run: per seed and per family, the candidate with the best avg@k on validation problems the test never uses, then that
candidate's test row, once.

    python benchmarks/tip_pick.py --run runs/tip-fair --seeds 0 1 2 --out runs/tip-pick

Families (each seed's own checkpoints):
- Dense: 500 SFT steps (``dense``), 1,000 (``dense-long``), and Dense-GRPO's kept checkpoints (``dense-grpo``);
- TIP: register SFT (``sft``) and TIP's GRPO's kept checkpoints (``grpo``).

Validation: the same evaluation as the test (``sliderl eval`` of the seed's ``eval.yaml``: problems, k, temperature,
top-p, sampling seeds) on the eval split of another task seed (``--validation task.seed=1``): problems generated
apart from the training and test problems (the script checks that no validation prompt is a test prompt). The
pick is the highest validation avg@k, ties to the candidate with less mean live KV. Test rows come from the run's
own evaluation (``sS/eval/results.jsonl``) when it holds the picked checkpoint, else the test is run for the pick
alone. Writes ``OUT/sS/validation/`` (rows), ``OUT/picks.jsonl`` and ``OUT/summary.md``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SLIDERL = [sys.executable, "-m", "sliderl.cluster.cli"]


def candidates(seed_dir: Path) -> dict[str, list[dict]]:
    """family -> entries (label, checkpoint, kv) of one seed's finished run."""
    def steps(run: str) -> list[Path]:
        return sorted((seed_dir / run / "checkpoints").glob("step_*"))

    dense = [{"label": "Dense (500 SFT)", "checkpoint": seed_dir / "dense" / "model", "kv": "full"},
             {"label": "Dense-long (1000 SFT)", "checkpoint": seed_dir / "dense-long" / "model", "kv": "full"}]
    dense += [{"label": f"Dense-GRPO {p.name}", "checkpoint": p, "kv": "full"} for p in steps("dense-grpo")]
    tip = [{"label": "TIP-SFT", "checkpoint": seed_dir / "sft" / "model", "kv": "registers:12"}]
    tip += [{"label": f"TIP {p.name}", "checkpoint": p, "kv": "registers:12"} for p in steps("grpo")]
    return {"Dense": dense, "TIP": tip}


def evaluate(base: Path, entries: list[dict], out: Path, overrides: list[str]) -> list[dict]:
    """``sliderl eval`` of ``base`` (a seed's eval.yaml) with only ``entries``, into ``out``; its rows."""
    cfg = yaml.safe_load(base.read_text())
    cfg["eval"]["compare"]["entries"] = [{**e, "checkpoint": str(e["checkpoint"])} for e in entries]
    cfg["eval"]["compare"]["output_dir"] = str(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "eval.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    with open(out / "eval.log", "w") as log:
        subprocess.run([*SLIDERL, "eval", str(out / "eval.yaml"), *overrides], cwd=ROOT, stdout=log,
                       stderr=subprocess.STDOUT, check=True)
    return [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]


def prompts(eval_dir: Path) -> set[str]:
    """The prompts an evaluation scored (its config's task, regenerated)."""
    from sliderl.cluster.cli import eval_problems
    from sliderl.cluster.config.base import load_config
    from sliderl.cluster.config.train import TrainConfig

    return {p.prompt for p in eval_problems(load_config(TrainConfig, eval_dir / "config.yaml", []))}


def pick(rows: list[dict]) -> dict:
    """The best validation row: highest avg@k, then least mean live KV."""
    return max(rows, key=lambda r: (r["avg_at_k"], -r["mean_live_kv"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", type=Path, required=True, help="a finished tip_seeds.py --dense-arms --out folder")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--validation", nargs="+", default=["task.seed=1"],
                        help="settings that turn the test evaluation into the validation one")
    parser.add_argument("--out", type=Path, default=Path("runs/tip-pick"))
    args = parser.parse_args()
    run, out = args.run.resolve(), args.out.resolve()
    picks = []
    for seed in args.seeds:
        seed_dir, seed_out = run / f"s{seed}", out / f"s{seed}"
        families = candidates(seed_dir)
        entries = [e for family in families.values() for e in family]
        rows = {r["label"]: r for r in evaluate(seed_dir / "eval.yaml", entries, seed_out / "validation",
                                                 args.validation)}
        overlap = prompts(seed_out / "validation") & prompts(seed_dir / "eval")
        if overlap:
            raise SystemExit(f"seed {seed}: {len(overlap)} validation prompts are test prompts, e.g. {sorted(overlap)[0]!r}")
        tested = {str(Path(r["checkpoint"]).resolve()): r
                  for r in map(json.loads, (seed_dir / "eval" / "results.jsonl").read_text().splitlines())
                  if r.get("budget_of") is None}
        for family, members in families.items():
            best = pick([rows[e["label"]] for e in members])
            entry = next(e for e in members if e["label"] == best["label"])
            test = tested.get(str(Path(entry["checkpoint"]).resolve()))
            if test is None:  # the pick has no test row yet: its one test evaluation
                test = evaluate(seed_dir / "eval.yaml", [entry], seed_out / f"test-{family}", [])[0]
            picks.append({"seed": seed, "family": family, "picked": best["label"], "checkpoint": str(entry["checkpoint"]),
                          "validation": {r["label"]: r["avg_at_k"] for r in (rows[e["label"]] for e in members)},
                          "test_avg_at_k": test["avg_at_k"], "test_pass_at_k": test["pass_at_k"],
                          "mean_live_kv": test["mean_live_kv"], "peak_live_kv": test["peak_live_kv"],
                          "kv_token_steps": test.get("kv_token_steps", 0.0)})
            print(f"seed {seed} {family}: picked {best['label']} (validation {best['avg_at_k']:.3f}) -> "
                  f"test {test['avg_at_k']:.3f}", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / "picks.jsonl").write_text("".join(json.dumps(p) + "\n" for p in picks))
    (out / "summary.md").write_text(summary(picks, args))
    print(summary(picks, args))


def summary(picks: list[dict], args: argparse.Namespace) -> str:
    lines = [f"# TIP vs Dense, checkpoints picked on validation ({' '.join(args.validation)}) — "
             f"`python benchmarks/tip_pick.py --run {args.run} --seeds {' '.join(map(str, args.seeds))}`", "",
             "| family | picks (per seed) | test avg@k | mean live KV | peak live KV | KV x steps |", "|---|---|---|---|---|---|"]
    for family in ("Dense", "TIP"):
        rows = [p for p in picks if p["family"] == family]
        acc = [p["test_avg_at_k"] for p in rows]
        sd = statistics.stdev(acc) if len(acc) > 1 else 0.0
        lines.append(f"| {family} | {', '.join(p['picked'] for p in rows)} | {statistics.mean(acc):.3f} ± {sd:.3f} "
                     f"({', '.join(f'{a:.3f}' for a in acc)}) | {statistics.mean(p['mean_live_kv'] for p in rows):.1f} | "
                     f"{max(p['peak_live_kv'] for p in rows):.0f} | {statistics.mean(p['kv_token_steps'] for p in rows):.0f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
