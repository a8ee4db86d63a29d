"""Accuracy and decode throughput of one checkpoint per window size — the Prefix Sliding paper's Table 1 in shape.

Every entry is a KV policy the checkpoint decodes under: ``prefix_sliding:W`` for each ``--windows`` W, and
``sliding_window:W`` for each ``--sliding`` W (``--full`` adds ``full``). Each entry is one
``sliderl eval COMPARE.yaml`` run with that single entry, greedy (k = 1, temperature 0), on the first
``--problems`` eval problems of ``--config``'s task (``overrides`` apply to it); the entries run as parallel
processes (``--parallel``), so on a GPU they share it and their tok/s are measured side by side (the same
contention for every entry; run ``--parallel 1`` for uncontended numbers). Writes ``accuracy_vs_w.md`` and
``accuracy_vs_w.jsonl`` (one row per entry: accuracy, tokens/s, decode seconds, mean live KV, tokens per
completion) to ``--out``; each entry's own ``sliderl eval`` output is in ``--out/<label>/``.

    python benchmarks/accuracy_vs_w.py $OUT/long-rl/arms/ps-trunc/final \\
        --config $OUT/long-rl/arms/ps-trunc/train.yaml --windows 128 256 512 1024 --sliding 512 --problems 64 --out $OUT/acc-w

    python benchmarks/accuracy_vs_w.py MODEL_DIR --smoke --out /tmp/acc-w       # CPU, long_rl.py --smoke's task

``benchmarks/long_rl.py`` runs the same entries (``run_evals``) after its arms, in one batch with the arms' own
evaluations.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import yaml  # noqa: E402

from benchmarks.long_rl_scales import SMOKE  # noqa: E402
from sliderl.cluster.config.base import load_config  # noqa: E402
from sliderl.cluster.config.train import TrainConfig  # noqa: E402
from sliderl.core.kv_policy import KVPolicy  # noqa: E402
from sliderl.rollout.block_bound import block_bound  # noqa: E402

PROMPT_SLACK = 16  # tokens a prompt template may add around a problem's text (byte-level: one token per character)


@dataclass(frozen=True)
class EvalEntry:
    """One evaluation: ``checkpoint`` decoding greedily under ``kv``, named ``label`` (a folder name too)."""

    label: str
    checkpoint: str
    kv: str


def window_entries(checkpoint: str, windows: list[int], sliding: list[int], full: bool = False) -> list[EvalEntry]:
    """The accuracy-vs-W entries of one checkpoint: ``ps<W>`` per window, ``sw<W>`` per sliding window, ``full``."""
    entries = [EvalEntry(f"ps{w}", checkpoint, f"prefix_sliding:{w}") for w in windows]
    entries += [EvalEntry(f"sw{w}", checkpoint, f"sliding_window:{w}") for w in sliding]
    return entries + ([EvalEntry("full", checkpoint, "full")] if full else [])


def pool_blocks(cfg: TrainConfig, kv: str, sequences: int, prompt_tokens: int) -> int:
    """KV blocks for ``sequences`` requests of ``prompt_tokens`` prompt tokens decoding at once under ``kv``
    (their block bounds, so a bounded policy is never short; ``full`` holds every position)."""
    engine, max_tokens = cfg.engine, cfg.eval.max_tokens or cfg.sampling.max_tokens
    max_model_len = engine.max_model_len or prompt_tokens + max_tokens + 1
    bound = block_bound(KVPolicy.parse(kv), prompt_tokens, max_tokens, max_model_len, engine.block_size,
                        engine.max_num_batched_tokens)
    return sequences * (bound + 1) + 1


def write_entry_config(entry: EvalEntry, config: str, overrides: list[str], problems: int, prompt_tokens: int,
                       out_dir: Path) -> Path:
    """``out_dir/<label>/compare.yaml``: ``config`` with ``overrides``, one greedy comparison entry, a KV pool sized
    for ``problems`` sequences under ``entry.kv``; returns its path."""
    cfg = load_config(TrainConfig, config, [*overrides, f"eval.num_problems={problems}"])
    data = cfg.model_dump(mode="json")
    data["warmstart"]["enabled"] = False
    if cfg.data.source == "task":  # eval problems only: the train split every process would write is not read
        data["task"]["train_size"] = 1
    data["engine"].update(kv=entry.kv, max_num_seqs=problems,
                          num_blocks=pool_blocks(cfg, entry.kv, problems, prompt_tokens))
    data["eval"]["compare"] = {"entries": [{"label": entry.label, "checkpoint": entry.checkpoint, "kv": entry.kv}],
                               "k": 1, "temperature": 0.0, "top_p": 1.0, "seeds": [0],
                               "output_dir": str(out_dir / entry.label)}
    path = out_dir / entry.label / "compare.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    load_config(TrainConfig, str(path))  # a bad entry fails here, before any process starts
    return path


def run_entry(config: Path, timeout_s: float) -> dict | None:
    """``sliderl eval config`` (its output in ``config``'s folder as ``eval.log``); its results row, or None when it
    failed or ran out of time."""
    log = config.parent / "eval.log"
    with open(log, "w") as out:
        try:
            code = subprocess.run([sys.executable, "-m", "sliderl.cluster.cli", "eval", str(config)], stdout=out,
                                  stderr=subprocess.STDOUT, cwd=ROOT, timeout=max(1.0, timeout_s)).returncode
        except subprocess.TimeoutExpired:
            out.write(f"\n(stopped after {timeout_s:.0f} s)\n")
            return None
    results = config.parent / "results.jsonl"
    if code != 0 or not results.is_file():
        return None
    return json.loads(results.read_text().splitlines()[0])


def run_evals(entries: list[EvalEntry], config: str, overrides: list[str], problems: int, prompt_tokens: int,
              out_dir: Path, parallel: int, timeout_s: float) -> dict[str, dict]:
    """Every entry as its own ``sliderl eval`` process, ``parallel`` at a time; ``{label: row}`` of those that
    finished (row: ``accuracy``, ``tokens_per_second``, ``decode_seconds``, ``mean_live_kv``, ``tokens``, ...)."""
    configs = [write_entry_config(e, config, overrides, problems, prompt_tokens, out_dir) for e in entries]
    deadline = time.monotonic() + timeout_s
    with ThreadPoolExecutor(max(1, parallel)) as pool:
        rows = list(pool.map(lambda c: run_entry(c, deadline - time.monotonic()), configs))
    return {e.label: summary_row(e, r) for e, r in zip(entries, rows) if r is not None}


def summary_row(entry: EvalEntry, result: dict) -> dict:
    """The numbers of one entry's ``results.jsonl`` row that the tables show."""
    return {"label": entry.label, "kv": entry.kv, "checkpoint": entry.checkpoint, "problems": result["num_problems"],
            "accuracy": result["avg_at_k"], "tokens_per_second": result["tokens_per_second"],
            "decode_seconds": result["decode_seconds"], "mean_live_kv": result["mean_live_kv"],
            "tokens_per_completion": result["generated_tokens"] / result["num_problems"]}


def window_of(kv: str) -> float:
    policy = KVPolicy.parse(kv)
    return policy.window if policy.window is not None else math.inf


def table(rows: list[dict]) -> str:
    """Markdown: one row per entry, prefix sliding by W first, then the others."""
    lines = ["| kv | accuracy | tok/s | decode s | mean live KV | tokens/completion | problems |",
             "|---|---|---|---|---|---|---|"]
    order = sorted(rows, key=lambda r: (not r["kv"].startswith("prefix_sliding"), window_of(r["kv"]), r["kv"]))
    for r in order:
        lines.append(f"| {r['kv']} | {r['accuracy']:.3f} | {r['tokens_per_second']:.0f} | {r['decode_seconds']:.1f} "
                     f"| {r['mean_live_kv']:.0f} | {r['tokens_per_completion']:.0f} | {r['problems']} |")
    return "\n".join(lines) + "\n"


def max_prompt_tokens(config: str, overrides: list[str]) -> int:
    """An upper bound on the eval prompts' tokens: the longest eval problem's characters plus the template's slack
    (the task's tokenizer is byte-level)."""
    from sliderl.cluster.cli import eval_problems

    cfg = load_config(TrainConfig, config, overrides)
    return max(len(p.prompt) for p in eval_problems(cfg)) + PROMPT_SLACK


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="a Hugging Face model directory (e.g. a run's checkpoints/step_N)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="settings for --config")
    parser.add_argument("--config", default=str(ROOT / "configs" / "long-rl.yaml"),
                        help="the train config whose task, data, engine and sampling the evaluation uses")
    parser.add_argument("--windows", type=int, nargs="*", default=[128, 256, 512, 1024])
    parser.add_argument("--sliding", type=int, nargs="*", default=[512], help="sliding_window:W entries")
    parser.add_argument("--full", action="store_true", help="add a full-attention entry")
    parser.add_argument("--problems", type=int, default=64, help="eval problems per entry")
    parser.add_argument("--parallel", type=int, default=8, help="entries evaluated at once")
    parser.add_argument("--timeout-s", type=float, default=300, help="stop every entry still running after this")
    parser.add_argument("--out", type=Path, default=Path("runs/accuracy-vs-w"))
    parser.add_argument("--smoke", action="store_true", help="CPU and long_rl.py --smoke's tiny task (the checkpoint: "
                        "any model with the byte-level tokenizer); windows 8 and 32, sliding 16, 4 problems")
    args = parser.parse_args()
    if args.smoke:
        args.overrides = [*SMOKE.train, *args.overrides]
        args.windows, args.sliding, args.problems = [8, 32], [16], 4
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    start = time.perf_counter()
    entries = window_entries(str(Path(args.checkpoint).resolve()), args.windows, args.sliding, args.full)
    prompt_tokens = max_prompt_tokens(args.config, args.overrides)
    rows = run_evals(entries, args.config, args.overrides, args.problems, prompt_tokens, args.out.resolve(),
                     args.parallel, args.timeout_s)
    missing = [e.label for e in entries if e.label not in rows]
    text = table(list(rows.values()))
    if missing:
        text += f"\nno result (failed or out of time): {', '.join(missing)}\n"
    (args.out / "accuracy_vs_w.md").write_text(text)
    (args.out / "accuracy_vs_w.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows.values()))
    print(f"{args.checkpoint}: greedy on {args.problems} eval problems, {args.parallel} entries at once\n")
    print(text + f"\ntotal {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
