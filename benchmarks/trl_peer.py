"""The peer row: TRL's ``GRPOTrainer`` and sliderl on the same model, data and GPU — time per RL step and tokens/s.

    python benchmarks/trl_peer.py --model DIR [--data FILE] [--steps 3] [--warmup 1] [--groups 4] \
        [--group-size 8] [--max-tokens 1024] [--sliderl OUT/colocate/results.jsonl] [--out DIR]
    python benchmarks/trl_peer.py --wheels        # the wheels TRL needs beyond the GPU machine's Python
    python benchmarks/trl_peer.py --cpu-smoke --out DIR

TRL (``TRL_WHEELS``; not a dependency of sliderl) runs GRPO the way its documentation shows, without
vLLM: the model loaded by ``from_pretrained`` (float32 weights, ``--trl-dtype bfloat16`` for bf16 ones; eager
attention, ``--trl-attn sdpa`` for SDPA, whose gradients were nan on the H200), bf16 autocast, gradient checkpointing,
completions sampled by transformers' ``generate`` (``--trl-generation cb``: transformers' continuous
batching instead). One optimizer step = ``--groups`` prompts x ``--group-size`` completions of at most
``--max-tokens`` tokens (``per_device_train_batch_size = group size``, ``gradient_accumulation_steps =
groups``: one generation per step, trained in ``groups`` micro-batches of one group), temperature 1,
lr 1e-6, no KL (beta 0). Prompts: the data's problems + the \\boxed{} instruction through the
tokenizer's chat template, as sliderl's ``data.chat_template`` writes them. Reward: math_verify
correctness (sliderl's own ``rewards.math.MathReward``) minus ``max(0, L - budget) / budget`` for a
completion of L tokens — random weights never answer right, and the length term gives each group the
reward variance that makes GRPO train (sliderl's row uses its KV penalty, which grows with length the
same way). The model is ``benchmarks/make_checkpoint.py``'s (its extra end ids make lengths vary; TRL and
sliderl stop on the same ids).

The sliderl row is ``benchmarks/colocate.py``'s ``keep`` run (the 1-GPU recipe in sync mode, as TRL's trainer
runs: learner and engine on this one GPU, truncated windows — at 1K tokens under prefix_sliding:1024 a trace is never cut,
so both train every completion token): ``--sliderl`` reads it from that script's results, after checking
that its step had the same shape; without it this script runs it. Per row, over the steps after
``--warmup``, median: step_s (wall seconds of one optimizer step, generation included), gen_s (TRL:
inside ``_generate``; sliderl: step - learner - sync), generated tokens per step, generation tok/s and
step tok/s (generated tokens / gen_s and / step_s), peak GPU memory.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# TRL and what it needs beyond the GPU machine's Python (torch, transformers, datasets, pyarrow, numpy,
# pandas, pyyaml, huggingface-hub are there or carried already): pass them to
# `bash ../shared/tools/device-wheels.sh` (fetched without dependencies).
TRL_WHEELS = ("trl==1.16.0", "accelerate==1.15.0", "psutil==7.2.2")


def trl_run(spec_path: Path) -> None:
    """``--run SPEC``: TRL's GRPO for ``warmup + steps`` optimizer steps in this process; per-step records to SPEC's out."""
    import torch
    from datasets import load_dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from sliderl.cluster.config.prompts import BOXED_INSTRUCTION
    from sliderl.rewards.math import MathReward

    spec = json.loads(spec_path.read_text())
    cpu = spec["cpu"]
    rows = load_dataset("json", data_files=spec["data"], split="train")
    if spec.get("max_prompt_chars"):
        rows = rows.filter(lambda r: len(r["problem"]) <= spec["max_prompt_chars"])
    rows = rows.map(lambda r: {"prompt": [{"role": "user", "content": f"{r['problem']}\n\n{BOXED_INSTRUCTION}"}]},
                    remove_columns=[c for c in rows.column_names if c not in ("answer",)])
    verify, budget = MathReward(), spec["length_budget"]

    def correctness(completions, answer, **_):
        return [verify(c[0]["content"], a).total for c, a in zip(completions, answer)]

    def length_penalty(completion_ids, **_):
        return [-max(0, len(ids) - budget) / budget for ids in completion_ids]

    records: list[dict] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            records.append({"begin": time.perf_counter(), "gen_s": 0.0, "tokens": 0})

        def on_step_end(self, args, state, control, **kw):
            records[-1]["end"] = time.perf_counter()
            Path(spec["out"]).write_text(json.dumps({"steps": records, "peak_gib": peak()}))

    def peak() -> float:
        return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0

    config = GRPOConfig(
        output_dir=spec["work_dir"], max_steps=spec["warmup"] + spec["steps"], learning_rate=1e-6, beta=0.0,
        per_device_train_batch_size=spec["group_size"], gradient_accumulation_steps=spec["groups"],
        num_generations=spec["group_size"], max_completion_length=spec["max_tokens"], temperature=1.0,
        bf16=not cpu, use_cpu=cpu, gradient_checkpointing=True, logging_steps=1, report_to=[], save_strategy="no",
        seed=0, model_init_kwargs={"dtype": "float32" if cpu else spec["dtype"], "attn_implementation": spec["attn"]},
        disable_tqdm=True,
        use_transformers_continuous_batching=spec["generation"] == "cb")
    trainer = GRPOTrainer(model=spec["model"], reward_funcs=[correctness, length_penalty], args=config,
                          train_dataset=rows, processing_class=AutoTokenizer.from_pretrained(spec["model"]),
                          callbacks=[Clock()])
    generate = trainer._generate

    def timed_generate(prompts):
        start = time.perf_counter()
        out = generate(prompts)
        records[-1]["gen_s"] += time.perf_counter() - start
        records[-1]["tokens"] += sum(len(ids) for ids in out[1])  # (prompt_ids, completion_ids, ...)
        return out

    trainer._generate = timed_generate
    trainer.train()


def trl_row(args) -> dict:
    """TRL's run in a child process under ``--run-timeout-s``; its row."""
    name = f"trl:{args.trl_generation}"
    spec = {"model": str(args.model), "data": str(args.data), "cpu": args.cpu_smoke, "steps": args.steps,
            "warmup": args.warmup, "groups": args.groups, "group_size": args.group_size,
            "max_tokens": args.max_tokens, "length_budget": args.kv_budget, "generation": args.trl_generation,
            "dtype": args.trl_dtype, "attn": args.trl_attn,
            "work_dir": str(args.work / "trl-work"), "out": str(args.work / "trl.child.json"),
            "max_prompt_chars": 400 if args.cpu_smoke else None}
    spec_path = args.work / "trl.spec.json"
    spec_path.write_text(json.dumps(spec, indent=1))
    from benchmarks.colocate import wait

    started = time.time()
    with (args.work / "trl.log").open("w") as log:
        child = subprocess.Popen([sys.executable, __file__, "--run", str(spec_path)], stdout=log, stderr=subprocess.STDOUT,
                                 start_new_session=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                     [str(ROOT), os.environ.get("PYTHONPATH", "")])})
        status = wait(child, args.run_timeout_s)
    out = Path(spec["out"])
    seen = json.loads(out.read_text()) if out.is_file() else {"steps": [], "peak_gib": 0.0}
    steps = [s for s in seen["steps"] if "end" in s]
    row = {"run": name, "status": status, "wall_s": time.time() - started, "peak_gib": seen["peak_gib"],
           "steps": steps, "timed_steps": max(0, len(steps) - args.warmup)}
    if row["timed_steps"]:
        timed = steps[args.warmup:]
        row.update(rates([s["end"] - s["begin"] for s in timed], [s["gen_s"] for s in timed],
                         [s["tokens"] for s in timed]))
    return row


def rates(step_s: list[float], gen_s: list[float], tokens: list[float]) -> dict:
    """Medians of step seconds, generation seconds and generated tokens per step, and the two rates."""
    step, gen, n = statistics.median(step_s), statistics.median(gen_s), statistics.median(tokens)
    return {"step_s": step, "gen_s": gen, "tokens_per_step": n, "gen_tok_s": n / max(gen, 1e-9),
            "step_tok_s": n / max(step, 1e-9)}


def sliderl_row(args) -> dict:
    """colocate.py's keep row (read from ``--sliderl``, or run now), checked to have this run's step shape."""
    from benchmarks.colocate import main as colocate

    results = args.sliderl
    if results is None:
        colocate_out = args.work / "sliderl"
        colocate([f"--model={args.model}", f"--data={args.data}", "--modes", "keep", "--steps", str(args.steps),
                  "--warmup", str(args.warmup), "--groups", str(args.groups), "--group-size", str(args.group_size),
                  "--max-tokens", str(args.max_tokens), "--kv-budget", str(args.kv_budget), "--out", str(colocate_out),
                  "--run-timeout-s", str(args.run_timeout_s), "--work", str(colocate_out)]
                 + (["--cpu-smoke"] if args.cpu_smoke else []))
        results = colocate_out / "results.jsonl"
    for line in results.read_text().splitlines():
        row = json.loads(line)
        if row["mode"] != "keep":
            continue
        check_same_shape(args, row["overrides"])
        gpus = row.get("gpus", {})
        out = {"run": f"sliderl:{row['kv']}", "status": row["status"], "wall_s": row["wall_s"],
               "peak_gib": max((g["peak_gib"] for g in gpus.values()), default=0.0), "timed_steps": row["timed_steps"]}
        if row["timed_steps"]:
            timed = row["steps"][-row["timed_steps"]:]
            times = [b["elapsed_s"] - a["elapsed_s"] for a, b in zip(row["steps"], row["steps"][1:])][-row["timed_steps"]:]
            gens = [t - s["learner_step_seconds"] - s.get("weight_sync_seconds", 0.0) for s, t in zip(timed, times)]
            out.update(rates(times, gens, [s["completion_tokens"] * args.groups * args.group_size for s in timed]))
        return out
    raise SystemExit(f"{results} has no keep run")


def check_same_shape(args, overrides: list[str]) -> None:
    """The sliderl run's step must be this run's: model, data, groups, group size, max tokens."""
    want = {"model.path": str(args.model), "data.source": str(args.data), "train.groups_per_step": str(args.groups),
            "rollout.group_size": str(args.group_size), "sampling.max_tokens": str(args.max_tokens)}
    have = dict(o.split("=", 1) for o in overrides)
    wrong = {k: (have.get(k), v) for k, v in want.items() if have.get(k) != v}
    if wrong:
        raise SystemExit(f"the sliderl run differs from this one (key: (theirs, ours)): {wrong}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--wheels", action="store_true", help="print the wheels TRL needs and exit")
    parser.add_argument("--model", type=Path)
    parser.add_argument("--data", type=Path)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=1024)
    parser.add_argument("--kv-budget", type=int, default=256, help="the length/KV penalty's budget (tokens)")
    parser.add_argument("--trl-generation", choices=("generate", "cb"), default="generate")
    # float32 weights under bf16 autocast, as sliderl's learner keeps float32 masters (on the H200 on 2026-12-02 both
    # dtypes logged grad_norm nan on the first step: docs/notebook/benchmarks.md, issue 15)
    parser.add_argument("--trl-dtype", choices=("float32", "bfloat16"), default="float32")
    # the attention TRL's model runs (transformers' attn_implementation). eager by default: on the H200
    # TRL's sdpa run logged grad_norm nan on its first step under both dtypes, the eager run trained with finite
    # gradients (3.03, 2.45); benchmarks/padded_grad.py's left-padded batch backward is finite under either on the
    # same GPU, so the nan is in TRL's sdpa path, not in padded attention as such (docs/notebook/benchmarks.md, issue 15)
    parser.add_argument("--trl-attn", choices=("sdpa", "eager"), default="eager")
    parser.add_argument("--sliderl", type=Path, help="colocate.py's results.jsonl holding the keep run")
    parser.add_argument("--run-timeout-s", type=float, default=280.0)
    parser.add_argument("--out", type=Path, default=Path("runs/trl_peer"), help="results.jsonl and trl.log")
    parser.add_argument("--work", type=Path, help="TRL's output folder and the runs (default: a new folder in /tmp)")
    parser.add_argument("--cpu-smoke", action="store_true")
    args = parser.parse_args(argv)
    if args.wheels:
        return print(" ".join(TRL_WHEELS))
    if args.run is not None:
        return trl_run(args.run)
    from benchmarks.colocate import prepare_inputs

    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    args.work = (args.work or Path(tempfile.mkdtemp(prefix="sliderl-trl-"))).resolve()
    args.work.mkdir(parents=True, exist_ok=True)
    args.size, args.stop_ids = "1.7b", 150
    prepare_inputs(args)
    print(f"# trl_peer {time.strftime('%Y-%m-%d %H:%M')} model {args.model} data {args.data.name}; {args.groups} "
          f"groups x {args.group_size} per step, <= {args.max_tokens} tokens, {args.warmup} warm-up + {args.steps} "
          "timed steps", flush=True)
    rows = [sliderl_row(args), trl_row(args)]
    with (args.out / "results.jsonl").open("w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    (args.out / "trl.log").write_text((args.work / "trl.log").read_text()[-200_000:])  # its end: few bytes come back
    cols = ("status", "step_s", "gen_s", "tokens_per_step", "gen_tok_s", "step_tok_s", "peak_gib")
    print(f"{'row':<28}" + "".join(f"{c:>16}" for c in cols))
    for r in rows:
        print(f"{r['run']:<28}" + "".join(f"{r[c]:>16.2f}" if isinstance(r.get(c), float) else f"{r.get(c, '-'):>16}"
                                           for c in cols))
    if all("step_s" in r for r in rows):
        print(f"TRL / sliderl step time = {rows[1]['step_s'] / rows[0]['step_s']:.2f}x")


if __name__ == "__main__":
    main()
