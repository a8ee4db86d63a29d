"""The Prefix Sliding paper's restart ablation (its Figure 9, Appendix G) in miniature, on CPU (issue 39, scope 5).

On the arithmetic task with chains whose traces are several times the memory budget B, four decoding modes at the
same budget — ``prefix_sliding:B`` (PS), ``sliding_window:B`` (SW), ``last_k:B:K`` and ``summary:B:S`` — each
trained with GRPO from the same warm start, for every seed; then evaluated (avg@k, temperature 1) under their own
mode at a few thinking caps (budget forcing), against thinking tokens and wall time (the paper's sampling:
temperature 0.6, top-p 0.95). Also the paper's training-free
ablation: the PS-trained model (and the warm start) decoded under every mode without training on it.

1. **Warm start** (two SFT stages of the one trainer, shared by every arm and seed): the task's plain reference
   solutions under PS (the tiny arith recipe: 800 steps), then example i under [PS, last_k, summary][i mod 3] —
   PS and last_k on the plain solution (last_k's restarts cut it mechanically, as the engine does), summary on
   ``solution_summary`` (a summary call every ``summary_lines`` step lines: the model must learn the tool, as the
   paper's prompt teaches it).
2. **GRPO arms**, one per (mode, seed): synchronous GRPO in process — the engine (``LLM``) samples the groups, the
   ``Learner`` trains on their traces (each restart trace segment by segment under its contexts), the weights go back
   to the engine — ``grpo_steps`` steps. Two arms run at once (one core each).
3. **Evaluation** of every final model under its mode at each thinking cap, and of the PS arm's final model and the
   warm start under every mode.

Written to ``--out``: ``rows.jsonl`` (every GRPO step of every arm, every evaluation: the raw rows),
``summary.md`` (mean ± sd over seeds), ``pareto.png`` (avg@k against thinking tokens and against wall seconds per
trace, one line per mode, mean ± sd over seeds), ``setup.json``.

    python benchmarks/restart_compare.py --out docs/results/restarts            # ~40 min on 2 busy cores
    python benchmarks/restart_compare.py --smoke --out /tmp/restart-compare    # seconds: the same pipeline
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import os
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@dataclass(frozen=True)
class Setup:
    """Everything one comparison depends on."""

    num_steps: tuple[int, int] = (10, 12)  # chain steps: completions of 96-110 byte tokens, ~3x the budget
    budget: int = 36  # B: PS / SW window, the restarts' N
    keep: int = 8  # last_k's K: a step line and one token
    summary_len: int = 10  # summary's S: "<tool_call>49 c..h</tool_call>" is 9 tokens
    summary_lines: int = 3  # step lines per segment in the summary demonstrations: 5 + 3·7 = 26 <= B - S, and
    # the answering segment "<think>\n53\n</think>\nAnswer: \boxed{53}" + eos is 26 tokens too
    hidden_size: int = 96
    intermediate_size: int = 384
    pre_sft_steps: int = 800  # SFT stage 1: the plain solutions under PS only (the tiny arith recipe)
    sft_steps: int = 600  # SFT stage 2: PS, last_k and summary examples taking turns, from stage 1
    sft_target: float = 0.0  # held-out greedy exact match that ends a stage early (0: every step)
    sft_lr: float = 0.01
    mix_lr: float = 0.005
    sft_init: str | None = None  # a model folder to start the SFT from (a shorter SFT's checkpoint); None: random
    grpo_steps: int = 16
    groups: int = 4
    group_size: int = 8
    lr: float = 3e-4
    max_tokens: int = 200
    eval_problems: int = 32
    k: int = 4
    eval_temperature: float = 0.6  # the paper's evaluation sampling (temperature 0.6, top-p 0.95)
    eval_top_p: float = 0.95
    caps: tuple[int | None, ...] = (64, 96, None)  # thinking caps (budget forcing); None: no cap
    seeds: tuple[int, ...] = (0, 1, 2)
    train_problems: int = 4096


SMOKE = Setup(num_steps=(3, 4), budget=16, keep=4, summary_len=10, summary_lines=1, hidden_size=32,
              intermediate_size=64, pre_sft_steps=2, sft_steps=2, grpo_steps=1, groups=1, group_size=2,
              max_tokens=64, eval_problems=2, k=1, caps=(None,), seeds=(0,), train_problems=64)


def modes(s: Setup) -> dict[str, str]:
    b = s.budget
    return {"PS": f"prefix_sliding:{b}", "SW": f"sliding_window:{b}", "last_k": f"last_k:{b}:{s.keep}",
            "summary": f"summary:{b}:{s.summary_len}"}


def task(s: Setup):
    from sliderl.tasks.arith import ArithTask
    return ArithTask(num_steps=s.num_steps, summary_lines=s.summary_lines)


def engine_kw(s: Setup, batch: int) -> dict:
    return dict(block_size=8, num_blocks=64 * batch + 64, max_num_seqs=batch, max_num_batched_tokens=2048,
                summary_tool={"json_call": False}, max_model_len=1024)


# ---- 1. the warm start -----------------------------------------------------------------------------------
def warm_start(s: Setup, out: Path) -> Path:
    """Two SFT stages of the one trainer: the plain solutions under PS (the task itself: looking up each step's
    operation in the prompt, the arithmetic), then the three restart-capable policies' examples mixed."""
    from sliderl.core.restart import SummaryTool
    from sliderl.core.tiny import make_tiny_model
    from sliderl.trainer.learner_args import LearnerArgs
    from sliderl.trainer.sft import SFTArgs, SFTExample, run_sft

    plain, model = out / "warm" / "plain", out / "warm" / "model"
    if (model / "sft.json").is_file():
        return model
    m = modes(s)
    rows = task(s).problems(max(s.pre_sft_steps, s.sft_steps) * 16 + 96, "train")
    tool = SummaryTool(json_call=False)

    def stage(init, to, steps, lr, specs, solution_of) -> None:
        examples = [SFTExample(r["prompt"], r[solution_of(i)]) for i, r in enumerate(rows[:steps * 16 + 96])]
        args = LearnerArgs(algo={"type": "sft"}, lr=lr, weight_decay=0.01, adam_betas=(0.9, 0.98),
                           lr_schedule="cosine", warmup_steps=20, total_steps=steps, window_mode="full",
                           micro_batch_tokens=2048, vocab_policy=m["summary"])
        sft = SFTArgs(steps=steps, batch_size=16, check_every=50, target_accuracy=s.sft_target, log_every=50,
                      summary_tool=tool)
        result = run_sft(init, to, examples[:-96], examples[-96:], specs, args, sft)
        print(f"warm start {to.name}: {result.line()}", flush=True)

    if not (plain / "sft.json").is_file():
        init = Path(s.sft_init) if s.sft_init else make_tiny_model(
            out / "warm" / "init", "qwen3", hidden_size=s.hidden_size, num_layers=2, num_heads=4, num_kv_heads=2,
            intermediate_size=s.intermediate_size, seed=0)
        stage(init, plain, s.pre_sft_steps, s.sft_lr, [m["PS"]], lambda i: "solution")
    stage(plain, model, s.sft_steps, s.mix_lr, [m["PS"], m["last_k"], m["summary"]],
          lambda i: "solution_summary" if i % 3 == 2 else "solution")
    return model


# ---- 2. one GRPO arm --------------------------------------------------------------------------------------
def trace_of(out, spec: str, temperature: float, reward: float, index: str):
    from sliderl.core.trace import Trace
    return Trace(index, index.rsplit("-", 1)[0], index, 0, 0, spec, out.prompt_token_ids, out.token_ids, out.logprobs,
                 out.finish_reason, temperature=temperature, forced=out.forced, reward=reward,
                 restarts=list(getattr(out, "restarts", [])), kv_token_steps=out.kv.token_steps)


def score(outputs, answers) -> list[float]:
    from sliderl.rewards.arith import ArithVerifier
    verifier = ArithVerifier()
    return [verifier(o.text, a).total for o, a in zip(outputs, answers)]


def train_arm(s: Setup, warm: Path, name: str, seed: int, out: Path) -> list[dict]:
    """GRPO for ``grpo_steps`` under mode ``name``; the final model in ``out/arms/<name>-s<seed>``; the step rows."""
    import torch

    from sliderl.rollout import LLM, SamplingParams
    from sliderl.trainer.learner import Learner

    torch.set_num_threads(1)
    spec, final = modes(s)[name], out / "arms" / f"{name}-s{seed}"
    batch = s.groups * s.group_size
    llm = LLM(str(warm), kv=spec, seed=seed, **engine_kw(s, batch))
    learner = Learner(str(warm), algo={"type": "grpo"}, lr=s.lr, window_mode="full", micro_batch_tokens=1024,
                      seed=seed, vocab_policy=modes(s)["summary"])
    problems = task(s).problems(s.train_problems, "train")
    rows, clock = [], {"generate": 0.0, "learn": 0.0}
    for step in range(s.grpo_steps):
        picked = [problems[(seed * 7919 + step * s.groups + g) % len(problems)] for g in range(s.groups)]
        prompts = [p["prompt"] for p in picked for _ in range(s.group_size)]
        params = [SamplingParams(max_tokens=s.max_tokens, temperature=1.0, seed=seed * 10**6 + step * 1000 + i)
                  for i in range(batch)]
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        t1 = time.perf_counter()
        rewards = score(outs, [p["answer"] for p in picked for _ in range(s.group_size)])
        traces = [trace_of(o, spec, 1.0, r, f"s{step}g{i // s.group_size}-{i}") for i, (o, r) in
                  enumerate(zip(outs, rewards))]
        metrics = learner.step([traces[g * s.group_size:(g + 1) * s.group_size] for g in range(s.groups)])
        llm.load_weights(learner.state_dict())
        t2 = time.perf_counter()
        clock["generate"] += t1 - t0
        clock["learn"] += t2 - t1
        rows.append({"kind": "grpo", "mode": name, "spec": spec, "seed": seed, "step": step + 1,
                     "accuracy": statistics.fmean(rewards), "tokens": statistics.fmean(len(o.token_ids) for o in outs),
                     "restarts": statistics.fmean(len(getattr(o, "restarts", [])) for o in outs),
                     "reencoded": statistics.fmean(sum(len(r.context_tail) for r in getattr(o, "restarts", []))
                                                   for o in outs),
                     "kv_token_steps": statistics.fmean(o.kv.token_steps for o in outs),
                     "stepped": metrics.stepped, "logprob_diff_max": metrics.logprob_diff_max,
                     "loss_tokens": metrics.num_loss_tokens, "input_tokens": metrics.num_tokens,
                     "generate_s": round(clock["generate"], 2), "learn_s": round(clock["learn"], 2)})
        print(f"{name}-s{seed} step {step + 1}/{s.grpo_steps} acc {rows[-1]['accuracy']:.3f} "
              f"tokens {rows[-1]['tokens']:.0f} gen {t1 - t0:.1f}s learn {t2 - t1:.1f}s", flush=True)
    learner.save_checkpoint(final)
    llm.close()
    return rows


# ---- 3. evaluation ----------------------------------------------------------------------------------------
def evaluate(s: Setup, model: Path, name: str, cap: int | None, seed: int, label: dict,
             spec: str | None = None) -> dict:
    """avg@k of ``model`` under mode ``name`` (or the policy ``spec``) at thinking cap ``cap`` on the first eval
    problems."""
    import torch

    from sliderl.core.vocab import END_THINK
    from sliderl.rollout import LLM, SamplingParams

    torch.set_num_threads(1)
    problems = task(s).problems(s.eval_problems, "eval")
    batch = len(problems) * s.k
    spec = spec or modes(s)[name]
    llm = LLM(str(model), kv=spec, seed=seed, **engine_kw(s, batch))
    prompts = [p["prompt"] for p in problems for _ in range(s.k)]
    params = [SamplingParams(max_tokens=s.max_tokens, temperature=s.eval_temperature, top_p=s.eval_top_p,
                             seed=seed * 10**6 + 999_000 + i, max_thinking_tokens=cap) for i in range(batch)]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    rewards = score(outs, [p["answer"] for p in problems for _ in range(s.k)])
    end = llm.tokenizer.convert_tokens_to_ids(END_THINK)
    thinking = [o.token_ids.index(end) if end in o.token_ids else len(o.token_ids) for o in outs]
    llm.close()
    return {"kind": "eval", **label, "mode": name, "spec": spec, "seed": seed, "cap": cap,
            "avg_at_k": statistics.fmean(rewards), "k": s.k, "problems": len(problems),
            "thinking_tokens": statistics.fmean(thinking), "tokens": statistics.fmean(len(o.token_ids) for o in outs),
            "seconds_per_trace": wall / batch,
            "restarts": statistics.fmean(len(getattr(o, "restarts", [])) for o in outs),
            "reencoded": statistics.fmean(sum(len(r.context_tail) for r in getattr(o, "restarts", [])) for o in outs),
            "kv_token_steps": statistics.fmean(o.kv.token_steps for o in outs),
            "peak_visible_kv": max(o.kv.peak_visible_tokens for o in outs)}


def arm_job(s: Setup, warm: Path, name: str, seed: int, out: Path) -> list[dict]:
    """Train one arm, then evaluate it under its own mode at every cap."""
    rows = train_arm(s, warm, name, seed, out)
    final = out / "arms" / f"{name}-s{seed}"
    return rows + [evaluate(s, final, name, cap, seed, {"model": f"{name}-trained"}) for cap in s.caps]


def free_job(s: Setup, model: Path, model_label: str, name: str, seed: int) -> list[dict]:
    """The training-free ablation: ``model`` decoded under mode ``name`` at every cap."""
    return [evaluate(s, model, name, cap, seed, {"model": model_label}) for cap in s.caps]


def k_sweep(s: Setup, out: Path, keeps: list[int], jobs: int) -> list[dict]:
    """The paper's Table 2 in miniature: the PS arms' final models decoded under last_k:B:K for each K (no cap),
    training-free; rows appended to ``out/k_sweep.jsonl``."""
    with ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = [pool.submit(evaluate, s, out / "arms" / f"PS-s{seed}", "last_k", None, seed,
                               {"model": "PS-trained", "keep": k}, f"last_k:{s.budget}:{k}")
                   for k in keeps for seed in s.seeds]
        rows = [f.result() for f in futures]
    with (out / "k_sweep.jsonl").open("w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    for k in keeps:
        acc = mean_sd([r["avg_at_k"] for r in rows if r["keep"] == k])
        print(f"last_k:{s.budget}:{k}  avg@{s.k} {acc[0]:.3f} ± {acc[1]:.3f}", flush=True)
    return rows


# ---- the run and its report -------------------------------------------------------------------------------
def run(s: Setup, out: Path, jobs: int) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    (out / "setup.json").write_text(json.dumps(dataclasses.asdict(s), indent=1) + "\n")
    t0 = time.perf_counter()
    import torch
    torch.set_num_threads(1)  # on 2 shared cores one thread per process beats two contending ones
    warm = warm_start(s, out)
    rows = [{"kind": "warm_start", "stage": stage.name, "seconds": round(time.perf_counter() - t0, 1),
             **{k: v for k, v in json.loads((stage / "sft.json").read_text())["result"].items() if k != "losses"}}
            for stage in (warm.parent / "plain", warm)]
    names = list(modes(s))
    with ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        arms = [pool.submit(arm_job, s, warm, name, seed, out) for seed in s.seeds for name in names]
        free = [pool.submit(free_job, s, warm, "warm-start", name, seed) for seed in s.seeds for name in names]
        for future in arms + free:
            rows += future.result()
        ps_free = [pool.submit(free_job, s, out / "arms" / f"PS-s{seed}", "PS-trained", name, seed)
                   for seed in s.seeds for name in names if name != "PS"]
        for future in ps_free:
            rows += future.result()
    with (out / "rows.jsonl").open("w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    report(rows, s, out)
    print(f"restart comparison: {time.perf_counter() - t0:.0f} s, rows in {out / 'rows.jsonl'}", flush=True)
    return rows


def mean_sd(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def eval_table(rows: list[dict], model_of) -> list[tuple]:
    """(mode, cap, avg@k, thinking tokens, s/trace, restarts, re-encoded) as (mean, sd) over seeds."""
    table = []
    for name in dict.fromkeys(r["mode"] for r in rows if r["kind"] == "eval"):
        for cap in dict.fromkeys(r["cap"] for r in rows if r["kind"] == "eval"):
            picked = [r for r in rows if r["kind"] == "eval" and r["mode"] == name and r["cap"] == cap
                      and r["model"] == model_of(name)]
            if picked:
                table.append((name, cap, *[mean_sd([r[key] for r in picked]) for key in
                                           ("avg_at_k", "thinking_tokens", "seconds_per_trace", "restarts",
                                            "reencoded")], len(picked)))
    return table


def report(rows: list[dict], s: Setup, out: Path) -> None:
    lines = [f"Budget B = {s.budget} (last_k K = {s.keep}, summary S = {s.summary_len}); chains of "
             f"{s.num_steps[0]}-{s.num_steps[1]} steps; avg@{s.k} on {s.eval_problems} eval problems at temperature "
             f"{s.eval_temperature}, top-p {s.eval_top_p}; "
             f"mean ± sd over seeds {list(s.seeds)}.", ""]
    fmt = lambda m: f"{m[0]:.3f} ± {m[1]:.3f}"  # noqa: E731
    sections = [("Each mode trained with GRPO under itself", lambda name: f"{name}-trained"),
                ("Training-free: the PS-trained model under each mode (PS's row is the PS arm's own)",
                 lambda name: "PS-trained"),
                ("The warm start under each mode (before RL)", lambda name: "warm-start")]
    for title, model_of in sections:
        table = eval_table(rows, model_of)
        lines += [f"### {title}", "", "| mode | thinking cap | avg@k | thinking tokens | s / trace | restarts | "
                  "re-encoded | seeds |", "|---|---|---|---|---|---|---|---|"]
        for name, cap, acc, think, sec, rst, reenc, n in table:
            lines.append(f"| {name} | {cap or '-'} | {fmt(acc)} | {think[0]:.1f} ± {think[1]:.1f} | {sec[0] * 1e3:.1f} ms "
                         f"| {rst[0]:.2f} | {reenc[0]:.1f} | {n} |")
        lines.append("")
    curves = [r for r in rows if r["kind"] == "grpo"]
    if curves:
        lines += ["### GRPO (rollout accuracy, first and last 5 steps' mean; learner seconds)", "",
                  "| mode | first 5 | last 5 | mean tokens | generate s | learn s | max logprob diff |",
                  "|---|---|---|---|---|---|---|"]
        for name in modes(s):
            arm = [r for r in curves if r["mode"] == name]
            if not arm:
                continue
            first = [r["accuracy"] for r in arm if r["step"] <= 5]
            last = [r["accuracy"] for r in arm if r["step"] > s.grpo_steps - 5]
            ends = [r for r in arm if r["step"] == s.grpo_steps]
            diffs = [r["logprob_diff_max"] for r in arm if r["logprob_diff_max"] is not None and r["step"] == 1]
            lines.append(f"| {name} | {statistics.fmean(first):.3f} | {statistics.fmean(last):.3f} | "
                         f"{statistics.fmean(r['tokens'] for r in arm):.0f} | "
                         f"{statistics.fmean(r['generate_s'] for r in ends):.0f} | "
                         f"{statistics.fmean(r['learn_s'] for r in ends):.0f} | "
                         f"{max(diffs) if diffs else float('nan'):.2e} |")
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    plot(rows, s, out)


def plot(rows: list[dict], s: Setup, out: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name in modes(s):
        table = eval_table(rows, lambda n: f"{n}-trained")
        points = [t for t in table if t[0] == name]
        free = [t for t in eval_table(rows, lambda n: "PS-trained") if t[0] == name and name != "PS"]
        for pts, style, label in ((points, "-o", f"{name} (trained)"), (free, ":x", f"{name} (PS-trained, no RL)")):
            if not pts:
                continue
            for ax, key in zip(axes, (3, 4)):
                ordered = sorted(pts, key=lambda t: t[key][0])
                xs = [t[key][0] * (1e3 if key == 4 else 1) for t in ordered]
                ax.errorbar(xs, [t[2][0] for t in ordered], yerr=[t[2][1] for t in ordered], fmt=style,
                            label=label, capsize=2, ms=4)
    axes[0].set(xlabel="thinking tokens per trace (mean)", ylabel=f"avg@{s.k}")
    axes[1].set(xlabel="wall ms per trace (CPU, batch wall / traces)", ylabel=f"avg@{s.k}")
    axes[0].legend(fontsize=7)
    fig.suptitle(f"restart baselines vs Prefix Sliding at budget {s.budget} (mean ± sd over {len(s.seeds)} seeds)")
    fig.tight_layout()
    fig.savefig(out / "pareto.png", dpi=120)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/restart-compare"))
    parser.add_argument("--smoke", action="store_true", help="a tiny model, 1 GRPO step, 2 eval problems")
    parser.add_argument("--jobs", type=int, default=2, help="arms run at once (one core each)")
    parser.add_argument("--report-only", action="store_true", help="redraw summary.md and pareto.png from rows.jsonl")
    parser.add_argument("--set", nargs="*", default=[], metavar="FIELD=VALUE", help="Setup fields (JSON values)")
    parser.add_argument("--k-sweep", type=int, nargs="*", default=None, metavar="K",
                        help="after a run: the PS arms' models under last_k:B:K for each K (training-free)")
    args = parser.parse_args(argv)
    s = SMOKE if args.smoke else Setup()
    s = dataclasses.replace(s, **{k: json.loads(v) for k, v in (kv.split("=", 1) for kv in args.set)})
    if args.k_sweep:
        return k_sweep(s, args.out, args.k_sweep, args.jobs)
    if args.report_only:
        rows = [json.loads(line) for line in (args.out / "rows.jsonl").read_text().splitlines()]
        report(rows, s, args.out)
        return rows
    return run(s, args.out, args.jobs)


if __name__ == "__main__":
    main()
