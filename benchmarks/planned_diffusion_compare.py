"""The thesis's comparison in miniature: autoregressive, Pasta and Planned Diffusion fine-tuned from one warm start.

Per seed, one tiny Qwen3 (``configs/planned-diffusion.yaml``'s shapes, random weights of that seed) is fine-tuned
three ways for the same steps on the same summed-chains problems (``tasks.planned_diffusion``, every chain a
fork/span): AR on the plain solutions (``kv=full``, SFT), Pasta on the Pasta-Lang ones (``kv=pasta``, SFT), PD on the
planned ones (``kv=planned_diffusion``, the hybrid objective). Every ``--eval-every`` steps the AR and PD models are
scored greedily on the held-out problems (PD at ``--knobs``' first setting): accuracy against finetuning steps. At
the end every model is scored, PD at each ``--knobs`` setting (its Pareto curve), with per response its sequential
forward passes (AR: engine steps; Pasta: ``PastaOutput.steps``; PD: ``PDOutput.forward_passes``) and, on the first
``--latency-problems``, the batch-1 wall time of each response generated alone.

    python benchmarks/planned_diffusion_compare.py all --seeds 0 1 2 --steps 1000 --out runs/pd-compare
    python benchmarks/planned_diffusion_compare.py run --system pd --seed 0 --steps 50 --out /tmp/pd-smoke

``all`` runs the (system, seed) jobs ``--jobs`` at a time (one process each, ``OMP_NUM_THREADS=1``) and writes
``rows.jsonl`` (one row per evaluation), ``summary.md`` and ``pareto.png`` under ``--out``. ``--device cuda`` trains
and evaluates on the GPU (the H200's batch-1 times: ``benchmarks/planned_diffusion_speedup.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SYSTEMS = {  # name: (KV policy, reference solution, algorithm)
    "ar": ("full", "solution_plain", "sft"),
    "pasta": ("pasta", "solution_pasta", "sft"),
    "pd": ("planned_diffusion", "solution", "planned_diffusion"),
}
TASK = dict(num_chains=(2, 3), num_steps=(6, 8), min_value=1, max_value=9, max_operand=1, fork_prob=1.0, seed=0)
MODEL = dict(hidden_size=96, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=384)
DEFAULT_KNOBS = ("0.5", "1.0", "0.25", "0.125", "0.5:0.9", "0.25:0.9", "0.5:uniform")


def parse_knobs(text: str) -> dict:
    """``RATIO[:CONFIDENCE][:uniform]`` -> the engine's pd_* arguments."""
    parts = text.split(":")
    knobs = {"pd_steps_ratio": float(parts[0]), "pd_confidence": None, "pd_order": "entropy"}
    for part in parts[1:]:
        if part in ("entropy", "uniform"):
            knobs["pd_order"] = part
        else:
            knobs["pd_confidence"] = float(part)
    return knobs


def evaluate(llm, problems: list[dict], system: str, max_tokens: int, latency_problems: int) -> dict:
    """Greedy accuracy, mean tokens and sequential forwards over ``problems`` (one batch), and the mean batch-1
    wall seconds of the first ``latency_problems`` generated alone."""
    from sliderl.rewards.arith import ArithVerifier
    from sliderl.rollout import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    outputs = llm.generate([p["prompt"] for p in problems], params)
    verifier = ArithVerifier()
    correct = [verifier(o.text, p["answer"]).total >= 1.0 for o, p in zip(outputs, problems)]
    forwards = [forward_passes(o, system) for o in outputs]
    seconds = []
    for p in problems[:latency_problems]:
        start = time.perf_counter()
        llm.generate([p["prompt"]], params)
        seconds.append(time.perf_counter() - start)
    return {"accuracy": sum(correct) / len(correct), "tokens": statistics.fmean(len(o.token_ids) for o in outputs),
            "forward_passes": statistics.fmean(forwards),
            "batch1_seconds": statistics.fmean(seconds) if seconds else None,
            "malformed": sum(malformed(o, system) for o in outputs)}


def forward_passes(output, system: str) -> int:
    if system == "pd":
        return output.planned_diffusion.forward_passes
    if system == "pasta":
        return output.pasta.steps
    return len(output.token_ids)  # a prefill and one decode per token after the first


def malformed(output, system: str) -> int:
    if system == "pd":
        return sum(vars(output.planned_diffusion.counts).values())
    if system == "pasta":
        return sum(vars(output.pasta.counts).values())
    return 0


def run_one(args: argparse.Namespace) -> list[dict]:
    """Fine-tune one system from one seed's warm start; its evaluation rows (also appended to OUT/rows.jsonl)."""
    import torch

    from sliderl.core.tiny import make_tiny_model
    from sliderl.rollout import LLM
    from sliderl.tasks.planned_diffusion import PlannedDiffusionTask
    from sliderl.trainer.algorithms import PlannedDiffusionOptions, SFTOptions
    from sliderl.trainer.learner import Learner
    from sliderl.trainer.learner_args import LearnerArgs
    from sliderl.trainer.sft import SFTExample, sft_trace

    torch.set_num_threads(1)
    kv, solution, algo = SYSTEMS[args.system]
    out = Path(args.out) / f"{args.system}-s{args.seed}"
    out.mkdir(parents=True, exist_ok=True)
    task = PlannedDiffusionTask(**{**TASK, "num_chains": tuple(args.num_chains), "num_steps": tuple(args.num_steps)})
    train, held_out = task.problems(args.train_size), task.problems(args.problems, "eval")
    base = make_tiny_model(out / "base", "qwen3", seed=args.seed, **MODEL)
    largs = LearnerArgs(algo=PlannedDiffusionOptions() if algo == "planned_diffusion" else SFTOptions(), lr=0.01,
                        weight_decay=0.01, adam_betas=(0.9, 0.98), lr_schedule="cosine", warmup_steps=20,
                        total_steps=args.steps, min_lr_ratio=0.1, window_mode="full", seed=args.seed, vocab_policy=kv,
                        device=args.device)
    learner = Learner(str(base), largs)
    traces = [sft_trace(learner.tokenizer, SFTExample(p["prompt"], p[solution]), kv, i) for i, p in enumerate(train)]
    knobs = [parse_knobs(k) for k in args.knobs] if args.system == "pd" else [{}]
    engine = dict(kv=kv, device=args.device, num_blocks=2048, max_num_seqs=128, pasta_max_forks=4, seed=args.seed)
    rows, t0 = [], time.perf_counter()

    def score(step: int, settings: list[dict], latency: int) -> None:
        state = learner.state_dict()
        for setting in settings:
            with LLM(str(base), **engine, **setting) as llm:
                llm.load_weights(state)
                result = evaluate(llm, held_out, args.system, args.max_tokens, latency)
            row = {"system": args.system, "seed": args.seed, "step": step, **{k: v for k, v in setting.items()},
                   **result, "train_seconds": round(time.perf_counter() - t0, 1)}
            rows.append(row)
            with open(Path(args.out) / "rows.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")
            print(json.dumps(row), flush=True)

    for step in range(1, args.steps + 1):
        first = (step - 1) * args.batch_size
        learner.step([[traces[(first + j) % len(traces)] for j in range(args.batch_size)]])
        if step == args.steps:
            learner.save_checkpoint(out / "model")  # for benchmarks/planned_diffusion_speedup.py trained
            (out / "task.json").write_text(json.dumps({**TASK, "num_chains": args.num_chains,
                                                       "num_steps": args.num_steps, "system": args.system}) + "\n")
            score(step, knobs, args.latency_problems)
        elif args.system != "pasta" and args.eval_every and step % args.eval_every == 0:
            score(step, knobs[:1], 0)
    return rows


def run_all(args: argparse.Namespace) -> None:
    """Every (system, seed) job as its own process, ``--jobs`` at a time; then the summary."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not args.append:
        (out / "rows.jsonl").unlink(missing_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    common = ["--num-chains", *map(str, args.num_chains), "--num-steps", *map(str, args.num_steps),
              "--steps", str(args.steps), "--eval-every", str(args.eval_every), "--problems", str(args.problems),
              "--train-size", str(args.train_size), "--batch-size", str(args.batch_size), "--max-tokens",
              str(args.max_tokens), "--latency-problems", str(args.latency_problems), "--device", args.device,
              "--out", str(out), "--knobs", *args.knobs]
    jobs = [(system, seed) for seed in args.seeds for system in args.systems if f"{system}-s{seed}" not in args.skip]

    def launch(job):
        system, seed = job
        log = out / f"{system}-s{seed}.log"
        cmd = [sys.executable, __file__, "run", "--system", system, "--seed", str(seed), *common]
        with open(log, "w") as f:
            start = time.perf_counter()
            code = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        if code:
            raise RuntimeError(f"{system} seed {seed} exited {code} (log: {log})")
        return time.perf_counter() - start

    start = time.perf_counter()
    with ThreadPoolExecutor(args.jobs) as pool:
        seconds = dict(zip(jobs, pool.map(launch, jobs)))
    print(f"all jobs: {time.perf_counter() - start:.0f} s; per job: " +
          ", ".join(f"{s}-s{d} {t:.0f} s" for (s, d), t in seconds.items()))
    summarize(out)


def summarize(out: Path, longer: Path | None = None) -> None:
    """``summary.md`` (final accuracy, forwards and batch-1 time per system and PD setting, mean ± std over seeds;
    accuracy against steps) and ``pareto.png`` from ``rows.jsonl``; with ``longer``, another run's rows (PD trained
    for more steps) join the accuracy-against-steps panel."""
    rows = [json.loads(line) for line in open(out / "rows.jsonl")]
    extra = [json.loads(line) for line in open(longer / "rows.jsonl")] if longer is not None else []
    final = max(r["step"] for r in rows)
    groups: dict[str, list[dict]] = {}
    for r in rows:
        if r["step"] == final:
            groups.setdefault(label(r), []).append(r)
    ar = {r["seed"]: r for r in rows if r["step"] == final and r["system"] == "ar"}
    lines = [f"final step {final}; mean ± std over seeds; speedups against the AR model of the same seed", "",
             "| entry | seeds | accuracy | tokens | sequential forwards | forward speedup | batch-1 s (CPU) | "
             "wall speedup | malformed |", "|---|---|---|---|---|---|---|---|---|"]
    for name, rs in groups.items():
        fs = [ar[r["seed"]]["forward_passes"] / r["forward_passes"] for r in rs if r["seed"] in ar]
        ws = [ar[r["seed"]]["batch1_seconds"] / r["batch1_seconds"] for r in rs
              if r["seed"] in ar and r.get("batch1_seconds") and ar[r["seed"]].get("batch1_seconds")]
        lines.append(f"| {name} | {len(rs)} | {ms([r['accuracy'] for r in rs])} | {ms([r['tokens'] for r in rs], 1)} | "
                     f"{ms([r['forward_passes'] for r in rs], 1)} | {ms(fs)} | "
                     f"{ms([r['batch1_seconds'] for r in rs if r.get('batch1_seconds')])} | {ms(ws)} | "
                     f"{sum(r.get('malformed') or 0 for r in rs)} |")
    lines += ["", "accuracy against finetuning steps (AR, and PD at its first setting):", "",
              "| step | " + " | ".join(("ar", "pd")) + " |", "|---|---|---|"]
    first_pd = next((label(r) for r in rows if r["system"] == "pd"), None)
    for step in sorted({r["step"] for r in rows}):
        cells = []
        for name in ("ar", first_pd):
            acc = [r["accuracy"] for r in rows if r["step"] == step and label(r) == name]
            cells.append(ms(acc) if acc else "")
        lines.append(f"| {step} | " + " | ".join(cells) + " |")
    if extra:
        lines += ["", f"longer runs ({longer}): accuracy against steps", "", "| setting | step | seeds | accuracy |",
                  "|---|---|---|---|"]
        for lab in dict.fromkeys(label(r) for r in extra):
            for step in sorted({r["step"] for r in extra if label(r) == lab}):
                acc = [r["accuracy"] for r in extra if label(r) == lab and r["step"] == step]
                lines.append(f"| {lab} | {step} | {len(acc)} | {ms(acc)} |")
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot(rows, final, out / "pareto.png", extra)


def label(row: dict) -> str:
    if row["system"] != "pd":
        return row["system"]
    conf = f" conf {row['pd_confidence']}" if row.get("pd_confidence") is not None else ""
    order = " uniform" if row.get("pd_order") == "uniform" else ""
    return f"pd ratio {row['pd_steps_ratio']}{conf}{order}"


def ms(values: list[float], digits: int = 3) -> str:
    if not values:
        return "n/a"
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.fmean(values):.{digits}f} ± {sd:.{digits}f}"


def plot(rows: list[dict], final: int, path: Path, extra: list[dict] = ()) -> None:
    """Accuracy against sequential forwards and against batch-1 seconds (final step), and against steps."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    colours = {"ar": "tab:blue", "pasta": "tab:orange", "pd": "tab:green"}
    last = [r for r in rows if r["step"] == final]
    for ax, key, name in ((axes[0], "forward_passes", "sequential forward passes per response"),
                          (axes[1], "batch1_seconds", "batch-1 seconds per response (this machine)")):
        for lab in dict.fromkeys(label(r) for r in last):
            rs = [r for r in last if label(r) == lab and r.get(key)]
            if not rs:
                continue
            x, y = statistics.fmean(r[key] for r in rs), statistics.fmean(r["accuracy"] for r in rs)
            ax.scatter(x, y, color=colours[rs[0]["system"]])
            ax.annotate(lab.replace("pd ", ""), (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
        pd_points = sorted((statistics.fmean(r[key] for r in last if label(r) == lab and r.get(key)),
                            statistics.fmean(r["accuracy"] for r in last if label(r) == lab))
                           for lab in dict.fromkeys(label(r) for r in last if r["system"] == "pd")
                           if any(r.get(key) for r in last if label(r) == lab))
        front = [p for p in pd_points if not any(q[0] <= p[0] and q[1] > p[1] for q in pd_points)]
        if front:  # PD's Pareto front: no setting takes fewer forwards (or seconds) to a higher accuracy
            ax.plot(*zip(*front), color=colours["pd"], alpha=0.4)
        if not any(r.get(key) for r in last):
            ax.text(0.5, 0.5, "no batch-1 times in these rows", ha="center", transform=ax.transAxes)
        ax.set_xlabel(name)
        ax.set_ylabel("held-out accuracy (greedy)")
    first_pd = next((label(r) for r in rows if r["system"] == "pd"), None)
    for lab, colour in (("ar", colours["ar"]), (first_pd, colours["pd"])):
        steps = sorted({r["step"] for r in rows if label(r) == lab})
        acc = [statistics.fmean(r["accuracy"] for r in rows if label(r) == lab and r["step"] == s) for s in steps]
        axes[2].plot(steps, acc, marker="o", color=colour, label=lab)
    lab = next((label(r) for r in extra if r["system"] == "pd"), None)
    if lab is not None:
        steps = sorted({r["step"] for r in extra if label(r) == lab})
        acc = [statistics.fmean(r["accuracy"] for r in extra if label(r) == lab and r["step"] == s) for s in steps]
        last = max(steps)
        axes[2].plot(steps, acc, marker="s", linestyle="--", color=colours["pd"],
                     label=f"{lab}, {last}-step schedule ({len({r['seed'] for r in extra})} seeds)")
    axes[2].set_xlabel("finetuning steps")
    axes[2].set_ylabel("held-out accuracy (greedy)")
    axes[2].legend(fontsize=8)
    fig.suptitle("AR, Pasta and Planned Diffusion from one warm start (mean over seeds)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=("all", "run", "summarize"))
    parser.add_argument("--system", choices=tuple(SYSTEMS), help="run: which system")
    parser.add_argument("--seed", type=int, default=0, help="run: the seed")
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=tuple(SYSTEMS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--num-chains", nargs=2, type=int, default=list(TASK["num_chains"]), help="fewest, most")
    parser.add_argument("--num-steps", nargs=2, type=int, default=list(TASK["num_steps"]), help="per chain")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--eval-every", type=int, default=250)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--train-size", type=int, default=4096)
    parser.add_argument("--problems", type=int, default=64, help="held-out problems scored")
    parser.add_argument("--latency-problems", type=int, default=8, help="of those, timed alone (batch 1)")
    parser.add_argument("--max-tokens", type=int, default=400)
    parser.add_argument("--knobs", nargs="+", default=list(DEFAULT_KNOBS), help="PD settings RATIO[:CONF][:uniform]")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--append", action="store_true", help="all: keep OUT/rows.jsonl's rows (a run resumed)")
    parser.add_argument("--skip", nargs="*", default=[], help="all: jobs already done, as SYSTEM-sSEED")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", default="runs/pd-compare")
    parser.add_argument("--longer", help="summarize: a run of PD alone for more steps, for the steps panel")
    args = parser.parse_args()
    if args.mode == "run":
        if args.system is None:
            parser.error("run needs --system")
        run_one(args)
    elif args.mode == "all":
        run_all(args)
    else:
        summarize(Path(args.out), Path(args.longer) if args.longer else None)


if __name__ == "__main__":
    main()
