"""benchmarks/pasta_seeds.py: its summary over seeds against hand-computed means, deviations and acceptance
deltas, and a smoke run of the whole chain (Baseline-SFT, Pasta-SFT, BoNBoN, eval) at a tiny size."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.pasta_seeds import summarize

ROOT = Path(__file__).resolve().parents[1]


def write_results(out: Path, seed: int, rows: dict[str, tuple[float, float]]) -> None:
    folder = out / f"s{seed}" / "eval"
    folder.mkdir(parents=True)
    lines = [{"label": label, "avg_at_k": acc, "speedup": speed, "generated_tokens": 400, "num_problems": 4, "k": 1}
             for label, (acc, speed) in rows.items()]
    (folder / "results.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))


# catches: a summary that mixes up entries or seeds (planted: the deltas taken Baseline - Pasta), a population
# sd where the table promises the sample sd, a missing plot.
def test_summary_by_hand(tmp_path):
    write_results(tmp_path, 0, {"Baseline-SFT": (0.50, 1.0), "Pasta-SFT": (0.48, 1.10), "Pasta-BoNBoN": (0.47, 1.32)})
    write_results(tmp_path, 1, {"Baseline-SFT": (0.60, 1.0), "Pasta-SFT": (0.60, 1.05), "Pasta-BoNBoN": (0.59, 1.26)})
    text = summarize(tmp_path, [0, 1], {0: {"eval": 1.0}, 1: {"eval": 2.0}})
    # Baseline-SFT accuracy: mean 0.55, sample sd |0.6 - 0.5| / sqrt(2) = 0.0707
    assert "| Baseline-SFT | 0.550 ± 0.071 | 1.000 ± 0.000 | 100.0 |" in text
    # BoNBoN / Pasta-SFT speedup per seed: 1.32 / 1.10 = 1.2, 1.26 / 1.05 = 1.2
    assert "| Pasta-BoNBoN / Pasta-SFT speedup | 1.200 ± 0.000 | 1.200, 1.200 |" in text
    # Pasta-SFT - Baseline-SFT accuracy in points: -2, 0 -> mean -1, sd sqrt(2) = 1.414
    assert "| Pasta-SFT − Baseline-SFT accuracy (points) | -1.000 ± 1.414 | -2.000, 0.000 |" in text
    rows = [json.loads(line) for line in (tmp_path / "summary.jsonl").read_text().splitlines()]
    assert rows[1]["label"] == "Pasta-SFT" and rows[1]["per_seed_speedup"] == [1.10, 1.05]
    assert rows[-1]["deltas"]["Pasta-BoNBoN − Pasta-SFT accuracy (points)"] == pytest.approx([-1.0, -1.0])
    assert (tmp_path / "quality_vs_speedup.png").stat().st_size > 0 and (tmp_path / "summary.md").read_text() == text


# catches: a chain whose commands do not fit together as docs/guide.md runs them (a stage's output not where the
# next one looks, the eval's checkpoints not rewritten per seed, a BoNBoN run without its baseline).
@pytest.mark.slow
@pytest.mark.timeout(1300)  # its own subprocess limits are longer than the suite's per-test timeout
def test_smoke_run_of_one_seed(tmp_path):
    # A 4-step model's samples (and Baseline-SFT's answer) all run to max_tokens, none right: every sample scores
    # speedup 1 + λ·0 and BoNBoN finds no pair, so the run would rightly fail as "nothing trained". BoNBoN's
    # quality is a thinking penalty here (the random text's whitespace words before its first </think>), which
    # spreads each group's scores.
    spread = ["reward.thinking_penalty.budget=1", "reward.thinking_penalty.weight=0.01",
              "learner.algo.quality_key=thinking_penalty"]
    tiny = ["model.hidden_size=32", "model.num_layers=1", "model.num_heads=2", "model.num_kv_heads=1",
            "model.intermediate_size=64"]
    cmd = [sys.executable, "benchmarks/pasta_seeds.py", "--seeds", "0", "--out", str(tmp_path), "--bonbon-steps", "1",
           "--sft", "sft.steps=4", "sft.batch_size=4", "sft.check_every=4", "data.held_out=2", *tiny,
           "--train", "train.groups_per_step=2", "rollout.group_size=4", "task.train_size=2", "sampling.max_tokens=48",
           *spread,
           "eval.before=false", "eval.after=false", "monitor.wandb.mode=disabled", "monitor.include_dashboard=false",
           "monitor.plots=false", "--eval", "eval.num_problems=4", "sampling.max_tokens=24"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "summary.jsonl").read_text().splitlines()]
    assert [r["label"] for r in rows[:3]] == ["Baseline-SFT", "Pasta-SFT", "Pasta-BoNBoN"]
    assert rows[0]["speedup"] == pytest.approx(1.0)  # greedy Baseline-SFT against itself
    assert (tmp_path / "s0" / "bonbon" / "baseline_lengths.json").is_file()
