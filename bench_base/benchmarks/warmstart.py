"""Warm start of the default job's tiny model: SFT wall time and greedy accuracy per KV policy.

    python benchmarks/warmstart.py [--config configs/tiny-arith.yaml] [--eval 128] [--train-kv full ...]
                                   [--seeds 0 1 2] [--set steps=600 ...] [--out rows.json]

For each training visibility in ``--train-kv`` (default: the config's ``warmstart.train_kv``) and
each seed in ``--seeds`` (default: the config's):
warm-start a checkpoint with the config's ``task`` and ``warmstart`` settings (in a temporary
folder, so nothing is cached), then score it greedily with the engine on ``--eval`` eval problems
under ``prefix_sliding:W``, ``sliding_window:W`` (W from the config's ``engine.kv``) and ``full``.
Prints the SFT steps run (training stops early at the target accuracy), wall and CPU seconds, the
final loss, and one accuracy row per policy. CPU seconds count every thread of the process.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from rewards.arith import ArithTask, ArithVerifier  # noqa: E402
from rollout import LLM, SamplingParams  # noqa: E402
from rollout.kv_policy import KVPolicy  # noqa: E402
from trainer.warmstart import MARKER, warm_start  # noqa: E402

DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "tiny-arith.yaml"


def load(config: Path, overrides: list[str]) -> tuple[ArithTask, dict, int]:
    """(task, warm start settings without cache_dir, window W of the config's engine policy)."""
    data = yaml.safe_load(config.read_text())
    task_fields = {f.name for f in dataclasses.fields(ArithTask)}
    task = ArithTask(**{k: v for k, v in data["task"].items() if k in task_fields})
    settings = {k: v for k, v in data["warmstart"].items() if k not in ("cache_dir", "enabled")}
    for item in overrides:
        key, _, value = item.partition("=")
        settings[key] = yaml.safe_load(value)
    return task, settings, KVPolicy.parse(data["engine"]["kv"]).window


def evaluate(model_dir: Path, problems: list[dict], kv: str, max_tokens: int) -> dict:
    """Greedy accuracy of ``model_dir`` on ``problems`` with the engine under the KV policy ``kv``."""
    t0 = time.perf_counter()
    llm = LLM(str(model_dir), kv=kv, max_num_seqs=64, max_num_batched_tokens=4096, num_blocks=4096)
    outs = llm.generate([p["prompt"] for p in problems], SamplingParams(max_tokens=max_tokens, temperature=0.0))
    verifier = ArithVerifier()
    correct = sum(verifier(o.text, p["answer"]).total for o, p in zip(outs, problems))
    return {"kv": kv, "accuracy": correct / len(problems), "unparseable": verifier.num_unparseable / len(problems),
            "mean_visible_kv": sum(o.kv.mean_visible_tokens for o in outs) / len(outs),
            "seconds": round(time.perf_counter() - t0, 2)}


def run(task: ArithTask, settings: dict, window: int, num_eval: int) -> list[dict]:
    """Warm-start once with ``settings``; one row per evaluated policy."""
    with tempfile.TemporaryDirectory() as tmp:
        t0, cpu0 = time.perf_counter(), time.process_time()
        path = warm_start(tmp, task, log_every=100, **settings)
        sft = {"sft_seconds": round(time.perf_counter() - t0, 1),
               "sft_cpu_seconds": round(time.process_time() - cpu0, 1)}
        record = json.loads((path / MARKER).read_text())
        sft.update(seed=settings.get("seed", 0), steps_run=record["steps_run"], final_loss=record["losses"][-1])
        problems = task.problems(num_eval, "eval")
        policies = [f"prefix_sliding:{window}", f"sliding_window:{window}", "full"]
        evals = [evaluate(path, problems, kv, task.max_completion_chars() + 8) for kv in policies]
    return [{"train_kv": settings.get("train_kv", "full"), **sft, **e} for e in evals]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    parser.add_argument("--eval", type=int, default=128, help="eval problems per policy")
    parser.add_argument("--train-kv", nargs="*", default=None, help="training visibilities to compare")
    parser.add_argument("--seeds", type=int, nargs="*", default=None, help="warm start seeds (default: the config's)")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="warm start setting overrides")
    parser.add_argument("--out", type=Path, default=None, help="also write the rows as JSON here")
    args = parser.parse_args()
    task, settings, window = load(args.config, args.set)
    rows = []
    for train_kv in args.train_kv or [settings.get("train_kv", "full")]:
        for seed in args.seeds if args.seeds is not None else [settings.get("seed", 0)]:
            rows += run(task, {**settings, "train_kv": train_kv, "seed": seed}, window, args.eval)
    print(f"{'train_kv':<20}{'seed':>5}{'steps':>6}{'sft s':>8}{'sft cpu s':>10}{'loss':>8}  {'eval kv':<20}"
          f"{'accuracy':>9}{'unparsed':>9}{'mean vis':>9}{'eval s':>8}")
    for r in rows:
        print(f"{r['train_kv']:<20}{r['seed']:>5}{r['steps_run']:>6}{r['sft_seconds']:>8.1f}"
              f"{r['sft_cpu_seconds']:>10.1f}{r['final_loss']:>8.4f}  "
              f"{r['kv']:<20}{r['accuracy']:>9.3f}{r['unparseable']:>9.3f}{r['mean_visible_kv']:>9.1f}"
              f"{r['seconds']:>8.1f}")
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
