"""The default job's warm start as an SFT stage: step time against the old trainer, wall time, accuracy per policy.

    python benchmarks/sft.py compare [--steps 60] [--base 9495a84] [--config configs/tiny-arith.yaml]
    python benchmarks/sft.py run [--config ...] [--eval 128] [--train-kv full ...] [--seeds 0 1 2]
                                 [--set warmstart.sft.steps=600 ...] [--out rows.json]

compare: the same SFT steps (the config's warm start: model, problems, optimizer, schedule, its
visibility ``engine.kv``) timed in one process through the old second trainer (``trainer/warmstart.py`` at
``--base``, read with ``git show`` into a temporary module) and through ``Learner`` + SFT
(``trainer.sft``), plus one held-out check on 64 problems each; prints per-step medians, the
ratio new/old and the losses of both (they must agree closely: same data, same optimizer).

run (what benchmarks/warmstart.py measured): for each training visibility and seed, the job's
warm start in a temporary cache (so nothing is reused), then greedy accuracy with the engine on
``--eval`` eval problems under ``prefix_sliding:W``, ``sliding_window:W`` (W from ``engine.kv``) and
``full``: SFT steps run, wall and CPU seconds, final loss, one accuracy row per policy.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from sliderl.cluster.actors.warm_start import cached_warm_start  # noqa: E402
from sliderl.cluster.config.base import load_config  # noqa: E402
from sliderl.cluster.config.train import TrainConfig  # noqa: E402
from sliderl.cluster.run.sft_job import stage_examples  # noqa: E402
from sliderl.core.kv_policy import KVPolicy  # noqa: E402
from sliderl.core.tiny import make_tiny_model  # noqa: E402
from sliderl.rewards.arith import ArithVerifier  # noqa: E402
from sliderl.rollout import LLM, SamplingParams  # noqa: E402
from sliderl.trainer.learner import Learner  # noqa: E402
from sliderl.trainer.sft import MARKER, SFTExample, sft_trace  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = ROOT / "configs" / "tiny-arith.yaml"


def old_warmstart(base: str):
    """``trainer/warmstart.py`` as it was at commit ``base``, imported from a temporary file."""
    source = subprocess.run(["git", "show", f"{base}:trainer/warmstart.py"], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "old_warmstart.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("old_warmstart", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["old_warmstart"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def compare(cfg: TrainConfig, steps: int, base: str) -> dict:
    """Median seconds per SFT step and per held-out check, old trainer vs ``Learner``, on the same data.

    The two trainers alternate step by step, so a change of load on the machine hits both alike.
    """
    cfg = cfg.model_copy(update={"warmstart": cfg.warmstart.model_copy(
        update={"sft": dataclasses.replace(cfg.warmstart.sft, steps=steps)})})
    old, ws = old_warmstart(base), cfg.warmstart
    train, held_out = stage_examples(ws, cfg.task)  # the stage's own data: B problems per step, then held out
    rows = lambda examples: [{"prompt": e.prompt, "solution": e.completion} for e in examples]  # noqa: E731
    size = ws.sft.batch_size
    batches = [rows(train[i * size:(i + 1) * size]) for i in range(steps)]
    held_out = rows(held_out)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_model(Path(tmp) / "init", spec=cfg.model.spec())
        old_step, old_check = old_trainer(old, model_dir, cfg)
        new_step, new_check = new_trainer(cfg, model_dir)
        times: dict[str, list[float]] = {"old": [], "new": [], "old_check": [], "new_check": []}
        losses: dict[str, list[float]] = {"old": [], "new": []}
        for i, rows in enumerate(batches):
            for name, step in (("old", old_step), ("new", new_step)) if i % 2 else (("new", new_step), ("old", old_step)):
                t0 = time.perf_counter()
                losses[name].append(step(rows))
                times[name].append(time.perf_counter() - t0)
        for name, check in (("old_check", old_check), ("new_check", new_check)) * 3:
            t0 = time.perf_counter()
            check(held_out)
            times[name].append(time.perf_counter() - t0)
    median = {k: statistics.median(v) for k, v in times.items()}
    return {"steps": steps, "threads": torch.get_num_threads(), "old_step_s": median["old"],
            "new_step_s": median["new"], "ratio": median["new"] / median["old"], "old_check_s": median["old_check"],
            "new_check_s": median["new_check"], "check_ratio": median["new_check"] / median["old_check"],
            "max_loss_diff": max(abs(a - b) for a, b in zip(losses["old"], losses["new"])),
            "losses_every_10": [round(x, 4) for x in losses["new"][::10]]}


def old_trainer(old, model_dir: Path, cfg: TrainConfig):
    """(step(rows) -> loss, check(rows)) of the old warm start's loop, with the stage's optimizer settings."""
    from sliderl.core.loader import load_model, load_tokenizer

    args, steps = cfg.warmstart.learner, cfg.warmstart.learner.total_steps
    model, tokenizer = load_model(model_dir).train(), load_tokenizer(model_dir)
    policy = KVPolicy.parse(cfg.engine.kv)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay, betas=args.adam_betas)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: old.lr_factor(s, args.warmup_steps, steps))

    def step(rows: list[dict]) -> float:
        loss = old.sft_step(model, optimizer, old.make_batch(tokenizer, rows, policy))
        schedule.step()
        return loss

    return step, lambda rows: old.greedy_accuracy(model, old.make_batch(tokenizer, rows, policy))


def new_trainer(cfg: TrainConfig, model_dir: Path):
    """(step(rows) -> loss, check(rows)) of ``Learner`` + SFT, as ``trainer.sft.run_sft`` drives it."""
    learner = Learner(str(model_dir), cfg.warmstart.learner)
    kv = cfg.engine.kv
    traces = lambda rows: [[sft_trace(learner.tokenizer, SFTExample(p["prompt"], p["solution"]), kv, i)  # noqa: E731
                            for i, p in enumerate(rows)]]
    return lambda rows: learner.step(traces(rows)).loss, lambda rows: learner.evaluate(traces(rows))


def evaluate(model_dir: str, problems: list[dict], kv: str, max_tokens: int) -> dict:
    """Greedy accuracy of ``model_dir`` on ``problems`` with the engine under the KV policy ``kv``."""
    t0 = time.perf_counter()
    llm = LLM(model_dir, kv=kv, max_num_seqs=64, max_num_batched_tokens=4096, num_blocks=4096)
    outs = llm.generate([p["prompt"] for p in problems], SamplingParams(max_tokens=max_tokens, temperature=0.0))
    verifier = ArithVerifier()
    correct = sum(verifier(o.text, p["answer"]).total for o, p in zip(outs, problems))
    return {"kv": kv, "accuracy": correct / len(problems), "unparseable": verifier.num_unparseable / len(problems),
            "mean_visible_kv": sum(o.kv.mean_visible_tokens for o in outs) / len(outs),
            "seconds": round(time.perf_counter() - t0, 2)}


def run(config: str, overrides: list[str], num_eval: int) -> list[dict]:
    """The job's warm start in a fresh cache; one row per evaluated policy."""
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(TrainConfig, config, [*overrides, f"warmstart.cache_dir={tmp}"])
        t0, cpu0 = time.perf_counter(), time.process_time()
        stage = cfg.warmstart
        result, _ = cached_warm_start(stage.cache_dir, cfg.model.resolve(), *stage_examples(stage, cfg.task),
                                      cfg.engine.kv, stage.learner, stage.sft)  # in this process: timed here
        path = result.path
        sft = {"sft_seconds": round(time.perf_counter() - t0, 1),
               "sft_cpu_seconds": round(time.process_time() - cpu0, 1)}
        record = json.loads((Path(path) / MARKER).read_text())["result"]
        sft.update(train_kv=cfg.engine.kv, seed=cfg.model.seed, steps_run=record["steps_run"],
                   final_loss=record["losses"][-1])
        task, window = cfg.task.generator(), KVPolicy.parse(cfg.engine.kv).window
        problems = task.problems(num_eval, "eval")
        policies = [f"prefix_sliding:{window}", f"sliding_window:{window}", "full"]
        return [{**sft, **evaluate(path, problems, kv, task.max_completion_chars() + 8)} for kv in policies]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=("compare", "run"))
    parser.add_argument("--config", default=str(DEFAULT_CONFIG))
    parser.add_argument("--steps", type=int, default=60, help="compare: SFT steps timed per trainer")
    parser.add_argument("--base", default="9495a84", help="compare: the commit holding the old trainer")
    parser.add_argument("--eval", type=int, default=128, help="run: eval problems per policy")
    parser.add_argument("--train-kv", nargs="*", default=None, help="run: training visibilities to compare")
    parser.add_argument("--seeds", type=int, nargs="*", default=None, help="run: warm start seeds")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides")
    parser.add_argument("--out", type=Path, default=None, help="also write the result as JSON here")
    args = parser.parse_args()
    if args.mode == "compare":
        result = compare(load_config(TrainConfig, args.config, args.set), args.steps, args.base)
        print(json.dumps(result, indent=1))
    else:
        cfg = load_config(TrainConfig, args.config, args.set)
        result = []
        for kv in args.train_kv or [cfg.engine.kv]:
            for seed in args.seeds if args.seeds is not None else [cfg.model.seed]:
                result += run(args.config, [*args.set, f"engine.kv={kv}", f"model.seed={seed}"],
                              args.eval)
        print_rows(result)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


def print_rows(rows: list[dict]) -> None:
    print(f"{'train_kv':<20}{'seed':>5}{'steps':>6}{'sft s':>8}{'sft cpu s':>10}{'loss':>8}  {'eval kv':<20}"
          f"{'accuracy':>9}{'unparsed':>9}{'mean vis':>9}{'eval s':>8}")
    for r in rows:
        print(f"{r['train_kv']:<20}{r['seed']:>5}{r['steps_run']:>6}{r['sft_seconds']:>8.1f}"
              f"{r['sft_cpu_seconds']:>10.1f}{r['final_loss']:>8.4f}  {r['kv']:<20}{r['accuracy']:>9.3f}"
              f"{r['unparseable']:>9.3f}{r['mean_visible_kv']:>9.1f}{r['seconds']:>8.1f}")


if __name__ == "__main__":
    main()
