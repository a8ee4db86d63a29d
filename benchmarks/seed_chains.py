"""One chain of sliderl commands per seed, the seeds side by side: the staging that ``tip_seeds.py`` and
``pasta_seeds.py`` share. A seed's chain is two SFT runs at once, then stage 2 (``sliderl train`` from the first
SFT checkpoint), then ``sliderl eval`` of its checkpoints; each command's output goes to a log under ``OUT/sS/``,
and the summary over seeds is read back from every seed's ``OUT/sS/eval/results.jsonl``."""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
SLIDERL = [sys.executable, "-m", "sliderl.cluster.cli"]


def run(cmd: list[str], log: Path, seconds: float | None = None, why: str = "its time box") -> float:
    """Run one sliderl command (its output to ``log``); its wall seconds. A failure stops the chain. With
    ``seconds``, a command still running then is interrupted (SIGINT: the job shuts Ray down; its
    checkpoints stay) and counts as finished; ``why`` is the log's note on it."""
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
            out.write(f"\n[{Path(sys.argv[0]).stem}: stopped after {seconds:.0f} s, {why}]\n")
            return time.perf_counter() - start
    if code != 0:
        raise RuntimeError(f"exit {code}: {' '.join(cmd)} (log: {log})")
    return time.perf_counter() - start


def side_by_side(commands: dict[str, tuple[list[str], Path]]) -> dict[str, float]:
    """``name: (command, log)`` all run at once; each one's wall seconds by name, in the order given."""
    if not commands:
        return {}
    with ThreadPoolExecutor(len(commands)) as pool:
        running = {name: pool.submit(run, cmd, log) for name, (cmd, log) in commands.items()}
        return {name: job.result() for name, job in running.items()}


def device_args(device: str, train: bool) -> list[str]:
    if device == "cpu":
        return ["learner.device=cpu"] + (["engine.device=cpu"] if train else [])
    args = ["learner.device=cuda"]
    if train:  # every chain's Ray instance sees the one GPU; each actor takes a slice of it
        args += ["engine.device=cuda", "learner.num_gpus=0.2", "rollout.num_gpus=0.2"]
    return args


def sft_command(config: Path, output_dir: Path, seed: int, args: argparse.Namespace, *own: str) -> list[str]:
    """``sliderl sft config`` with ``own`` settings, seeded by ``seed``, then ``--sft``'s settings."""
    return [*SLIDERL, "sft", str(config), *own, f"output_dir={output_dir}", f"model.seed={seed}",
            f"learner.seed={seed}", *device_args(args.device, False), *args.sft_overrides]


def train_command(config: Path, run_dir: Path, sft_model: Path, seed: int, args: argparse.Namespace,
                  *own: str) -> list[str]:
    """Stage 2: ``sliderl train config`` from the SFT checkpoint ``sft_model`` (not re-run as its warm start) with
    ``own`` settings, then ``--train``'s. The chains run side by side: no dashboard, whose one port would collide."""
    return [*SLIDERL, "train", str(config), f"run_dir={run_dir}", "model.type=hf", f"model.path={sft_model}",
            "warmstart.enabled=false", f"train.seed={seed}", f"learner.seed={seed}", *own,
            *device_args(args.device, True), "monitor.include_dashboard=false", *args.train_overrides]


def eval_command(template: Path, seed_dir: Path, seed: int, args: argparse.Namespace,
                 checkpoint: Callable[[dict], Path]) -> list[str]:
    """``sliderl eval`` of ``seed_dir/eval.yaml``: the eval config ``template`` with each entry's checkpoint
    (``checkpoint(entry)``), this seed's output directory and sampling seed, then ``--eval``'s settings."""
    cfg = yaml.safe_load(template.read_text())
    for entry in cfg["eval"]["compare"]["entries"]:
        entry["checkpoint"] = str(checkpoint(entry))
    cfg["eval"]["compare"].update(seeds=[seed], output_dir=str(seed_dir / "eval"))
    cfg.setdefault("engine", {})["device"] = args.device
    path = seed_dir / "eval.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return [*SLIDERL, "eval", str(path), *args.eval_overrides]


def read_results(out: Path, seeds: list[int]) -> dict[str, list[dict]]:
    """label -> one results.jsonl row per seed."""
    rows: dict[str, list[dict]] = {}
    for seed in seeds:
        for line in (out / f"s{seed}" / "eval" / "results.jsonl").read_text().splitlines():
            row = json.loads(line)
            rows.setdefault(row["label"], []).append(row)
    return rows


def write_summary(out: Path, title: str, script: str, seeds: list[int], seconds: dict[int, dict],
                  body: list[str], records: list[dict]) -> str:
    """``OUT/summary.md`` (the title over ``seeds``, the command line that ran ``script``, ``body``, each seed's
    seconds per stage) and ``OUT/summary.jsonl`` (``records``, one a line); the markdown's text."""
    stages = "; ".join(f"seed {s}: " + ", ".join(f"{k} {v:.0f}" for k, v in seconds[s].items()) for s in seeds)
    lines = [f"# {title} over seeds {seeds} — `python benchmarks/{script} {' '.join(sys.argv[1:])}`", "", *body,
             "", "seconds per stage: " + stages]
    (out / "summary.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    text = "\n".join(lines) + "\n"
    (out / "summary.md").write_text(text)
    return text


def mean_sd(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (n - 1) over seeds; 0 for one seed."""
    return statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def add_chain_args(parser: argparse.ArgumentParser, out: str) -> None:
    """The options every seeds script takes: ``--seeds``, ``--device``, ``--out`` (default ``out``),
    ``--sft/--train/--eval KEY=VALUE ...`` (``args.{sft,train,eval}_overrides``) and ``--report-only``."""
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--out", type=Path, default=Path(out))
    for stage in ("sft", "train", "eval"):
        parser.add_argument(f"--{stage}", dest=f"{stage}_overrides", nargs="+", default=[], metavar="KEY=VALUE",
                            help=f"settings for every {stage} command (e.g. --sft sft.steps=900)")
    parser.add_argument("--report-only", action="store_true", help="redraw the summary and plots from --out")


def run_seeds(args: argparse.Namespace, chain: Callable[[int, argparse.Namespace], dict],
              summarize: Callable[[Path, list[int], dict[int, dict]], str]) -> None:
    """Every seed's ``chain`` at once (one thread each; a chain returns its seconds per stage), then the summary
    over seeds printed; with ``--report-only``, only the summary, redrawn from ``--out``."""
    if args.report_only:
        print(summarize(args.out, args.seeds, {s: {} for s in args.seeds}))
        return
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    start = time.perf_counter()
    with ThreadPoolExecutor(len(args.seeds)) as pool:
        seconds = dict(zip(args.seeds, pool.map(lambda s: chain(s, args), args.seeds)))
    print(summarize(args.out, args.seeds, seconds))
    print(f"all seeds: {time.perf_counter() - start:.0f} s")
