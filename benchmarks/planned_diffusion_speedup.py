"""Batch-1 latency of Planned Diffusion against autoregressive decoding (and Pasta), realised by the engine.

    python benchmarks/planned_diffusion_speedup.py scripted --device cuda --problems 6 --repeats 3 --out F.json
    python benchmarks/planned_diffusion_speedup.py trained --runs runs/pd-compare --device cuda --out F.json

- ``scripted``: on CUDA the Qwen3-1.7B config with random bf16 weights (CPU: a tiny Qwen3), the summed-chains
  task's held-out problems. The autoregressive engine (``kv=full``) is forced through the plain solution; the PD
  engine (``kv=planned_diffusion``) through the planned response's autoregressive tokens (the plan, its
  ``<sync/>``, the sum), its spans denoised by the model at each ``--knobs`` setting (steps ratio only: a random
  model's confidences mean nothing, so the number of denoising steps is the ratio's); the Pasta engine
  (``kv=pasta``) through the Pasta-Lang solution's threads. Each response is timed alone, median of
  ``--repeats`` after one untimed run.
- ``trained``: the checkpoints ``benchmarks/planned_diffusion_compare.py`` writes (``RUNS/{ar,pasta,pd}-sS/model``),
  greedy on the held-out problems of their task: accuracy over ``--problems`` (one batch) and the batch-1 wall time
  of the first ``--latency-problems`` generated alone, per system and PD setting.

Per row: sequential forward passes, wall seconds, and for PD the wall split into its denoising and commit forwards
(``PDRuntime.stats``) and the rest (autoregressive steps, CUDA graphs on GPU). On CUDA the engines keep their default
``cuda_graphs=True``, so PD's denoising forwards replay captured graphs of padded buckets (``span_graphs``; commits
stay eager); a PD row records whether they did (``pd_graphs``) and how many buckets its engine had captured by then
(``pd_graph_captures``: a problem's new buckets are captured in its untimed first run, its timed repeats replay).
Speedups are ratios against the autoregressive engine in the same run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.planned_diffusion_compare import forward_passes, parse_knobs  # noqa: E402
from sliderl.core.planned_diffusion import PD_TOKENS, PDLayout, PDTokenIds  # noqa: E402
from sliderl.rollout import LLM, SamplingParams  # noqa: E402


def engine_args(device: str, max_model_len: int) -> dict:
    dtype = "bfloat16" if device.startswith("cuda") else "float32"
    return dict(device=device, dtype=dtype, block_size=16, num_blocks=8 * (max_model_len // 16 + 3),
                max_model_len=max_model_len, max_num_seqs=16, pasta_max_forks=8)


def timed(llm: LLM, prompt: list[int], params: SamplingParams, scripts: dict[int, list[int]] | None, repeats: int):
    """Median wall seconds of one request alone (after an untimed run), its last output, and for PD the median
    seconds its runtime spent in denoising and commit forwards."""
    seconds, denoise, out = [], [], None
    for r in range(repeats + 1):
        stats = getattr(llm.mode, "stats", None)
        before = stats.seconds if stats is not None else 0.0
        if llm.device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        seq = llm.add_request(prompt, params)
        for thread, tokens in (scripts or {}).items():
            llm.force(seq, tokens, thread)
        while llm.has_unfinished():
            llm.step()
        if llm.device.type == "cuda":
            torch.cuda.synchronize()
        if r:
            seconds.append(time.perf_counter() - start)
            denoise.append((stats.seconds - before) if stats is not None else 0.0)
        out = llm.output(seq)
    return statistics.median(seconds), out, statistics.median(denoise)


def ar_script(tokenizer, prompt_len: int, planned: list[int]) -> list[int]:
    """The autoregressive tokens of a flattened PD response (the runtime writes the spans itself)."""
    layout = PDLayout.parse(prompt_len, planned, PDTokenIds.from_tokenizer(tokenizer), tokenizer.decode)
    keep = layout.ar_target_mask().tolist()
    return [t for t, k in zip(planned, keep) if k]


def row(problem: str, system: str, knobs: dict, seconds: float, out, denoise: float, llm: LLM,
        correct: bool | None = None):
    passes = forward_passes(out, system)
    r = {"problem": problem, "system": system, **knobs, "tokens": len(out.token_ids), "forward_passes": passes,
         "seconds": seconds, "ms_per_forward": 1e3 * seconds / passes}
    if system == "pd":
        pd = out.planned_diffusion
        n = pd.denoising_forwards + pd.commit_forwards
        r.update(denoising_forwards=pd.denoising_forwards, commit_forwards=pd.commit_forwards,
                 denoise_seconds=denoise, ms_per_denoise_forward=1e3 * denoise / n if n else None,
                 ms_per_ar_step=1e3 * (seconds - denoise) / max(passes - n, 1), rounds=len(pd.rounds))
        graphs = llm.mode.graphs  # SpanGraphs, None under cuda_graphs=False
        r.update(pd_graphs=graphs is not None and graphs.capture, pd_graph_captures=graphs.captures if graphs else 0)
    if correct is not None:
        r["correct"] = correct
    return r


def run_scripted(args) -> list[dict]:
    from benchmarks.pasta_speedup import layout_of, thread_scripts
    from sliderl.core.loader import load_tokenizer
    from sliderl.tasks.planned_diffusion import PlannedDiffusionTask

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        if args.device.startswith("cuda"):
            from sliderl.core.tiny import make_qwen3_1p7b
            path = make_qwen3_1p7b(Path(tmp) / "qwen3-1.7b-pd", device=args.device, extra_special_tokens=PD_TOKENS)
        else:
            from sliderl.core.tiny import make_tiny_model
            path = make_tiny_model(Path(tmp) / "tiny-pd", "qwen3", extra_special_tokens=PD_TOKENS, hidden_size=96,
                                   intermediate_size=384)
        tok = load_tokenizer(path)
        enc = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
        task = PlannedDiffusionTask(num_chains=tuple(args.num_chains), num_steps=tuple(args.num_steps), seed=0)
        problems = task.problems(args.problems, "eval")
        longest = max(len(enc(p["prompt"])) + len(enc(p["solution"])) for p in problems)
        common = engine_args(args.device, 2 * longest + 64)
        eos = tok.eos_token_id
        engines = {"ar": ("full", {}), "pasta": ("pasta", {}),
                   **{f"pd {k}": ("planned_diffusion", parse_knobs(k)) for k in args.knobs}}
        for name, (kv, knobs) in engines.items():
            with LLM(str(path), kv=kv, **common, **knobs) as llm:
                for p in problems:
                    prompt = enc(p["prompt"])
                    if kv == "full":
                        script, n = {0: enc(p["solution_plain"]) + [eos]}, len(enc(p["solution_plain"])) + 1
                    elif kv == "pasta":
                        ids = enc(p["solution_pasta"])
                        script, n = thread_scripts(layout_of(llm, len(prompt), ids), ids, eos), len(ids) + 1
                    else:
                        ids = enc(p["solution"])
                        script, n = {0: ar_script(tok, len(prompt), ids) + [eos]}, len(ids) + 1
                    params = SamplingParams(max_tokens=n, temperature=0.0)
                    seconds, out, denoise = timed(llm, prompt, params, script, args.repeats)
                    rows.append(row(p["prompt_id"], name.split()[0], knobs, seconds, out, denoise, llm))
                    print(json.dumps(rows[-1]), flush=True)
    return rows


def run_trained(args) -> list[dict]:
    from sliderl.rewards.arith import ArithVerifier
    from sliderl.tasks.planned_diffusion import PlannedDiffusionTask

    rows, verifier = [], ArithVerifier()
    for run in sorted(Path(args.runs).glob("*-s*")):
        if not (run / "model").is_dir() or run.name.split("-")[0] not in args.systems:
            continue
        task = json.loads((run / "task.json").read_text())
        system = task.pop("system")
        problems = PlannedDiffusionTask(**{k: tuple(v) if isinstance(v, list) else v for k, v in task.items()}
                                        ).problems(args.problems, "eval")
        kv = {"ar": "full", "pasta": "pasta", "pd": "planned_diffusion"}[system]
        settings = [parse_knobs(k) for k in args.knobs] if system == "pd" else [{}]
        for knobs in settings:
            with LLM(str(run / "model"), kv=kv, **engine_args(args.device, 1024), **knobs) as llm:
                params = SamplingParams(max_tokens=400, temperature=0.0)
                outs = llm.generate([p["prompt"] for p in problems], params)
                accuracy = statistics.fmean(verifier(o.text, p["answer"]).total for o, p in zip(outs, problems))
                rows.append({"run": run.name, "problem": "all", "system": system, **knobs, "accuracy": accuracy,
                             "problems": len(problems), "tokens": statistics.fmean(len(o.token_ids) for o in outs),
                             "forward_passes": statistics.fmean(forward_passes(o, system) for o in outs)})
                print(json.dumps(rows[-1]), flush=True)
                for p in problems[:args.latency_problems]:
                    prompt = llm.tokenizer(p["prompt"]).input_ids
                    seconds, out, denoise = timed(llm, prompt, params, None, args.repeats)
                    r = row(p["prompt_id"], system, knobs, seconds, out, denoise,
                            llm, verifier(out.text, p["answer"]).total >= 1.0)
                    rows.append({"run": run.name, "accuracy": accuracy, **r})
                    print(json.dumps(rows[-1]), flush=True)
    return rows


def summary(rows: list[dict]) -> str:
    """Per system and PD setting: mean forwards, median seconds, their ratios to the autoregressive engine's."""
    key = lambda r: (r.get("run", "").split("-")[-1], r["system"], r.get("pd_steps_ratio"),  # noqa: E731
                     r.get("pd_confidence"), r.get("pd_order"))
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if r["problem"] != "all":  # per-problem timings; a trained run's "all" rows hold its accuracy
            groups.setdefault(key(r), []).append(r)
    accuracy = {key(r): r["accuracy"] for r in rows if r["problem"] == "all"}
    lines = ["| seed | system | ratio | confidence | order | accuracy | forwards | batch-1 s | forward speedup | "
             "wall speedup | ms/AR step | ms/denoise fwd |", "|---" * 12 + "|"]
    for k in dict.fromkeys(key(r) for r in rows):
        rs = groups.get(k) or [r for r in rows if key(r) == k]  # no timings: the accuracy row's mean forwards
        ar = groups.get((k[0], "ar", None, None, None), [])
        base = {r["problem"]: r for r in ar}
        fs = [base[r["problem"]]["forward_passes"] / r["forward_passes"] for r in rs if r["problem"] in base]
        ws = [base[r["problem"]]["seconds"] / r["seconds"] for r in rs if r["problem"] in base]
        geo = lambda v: f"{statistics.geometric_mean(v):.3f}" if v else "n/a"  # noqa: E731
        acc = f"{accuracy[k]:.3f}" if k in accuracy else ""
        lines.append(f"| {k[0]} | {k[1]} | {k[2] or ''} | {k[3] or ''} | {k[4] or ''} | {acc} | "
                     f"{mean(rs, 'forward_passes')} | {mean(rs, 'seconds')} | {geo(fs)} | {geo(ws)} | "
                     f"{mean(rs, 'ms_per_ar_step')} | {mean(rs, 'ms_per_denoise_forward')} |")
    return "\n".join(lines)


def mean(rows: list[dict], name: str) -> str:
    values = [r[name] for r in rows if r.get(name) is not None]
    return f"{statistics.fmean(values):.2f}" if values else ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=("scripted", "trained"))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--problems", type=int, default=6)
    parser.add_argument("--latency-problems", type=int, default=8, help="trained: of the problems, timed alone")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--num-chains", nargs=2, type=int, default=[2, 4], help="scripted")
    parser.add_argument("--num-steps", nargs=2, type=int, default=[5, 6], help="scripted")
    parser.add_argument("--knobs", nargs="+", default=["1.0", "0.5", "0.25", "0.125"],
                        help="PD settings RATIO[:CONFIDENCE][:uniform] (scripted: ratios only are meaningful)")
    parser.add_argument("--runs", help="trained: benchmarks/planned_diffusion_compare.py's --out")
    parser.add_argument("--systems", nargs="+", default=["ar", "pasta", "pd"], help="trained: which models")
    parser.add_argument("--out", help="write the rows and the summary here (JSON)")
    args = parser.parse_args()
    if args.mode == "trained" and not args.runs:
        parser.error("trained needs --runs")
    start = time.perf_counter()
    rows = run_scripted(args) if args.mode == "scripted" else run_trained(args)
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    text = summary(rows)
    graphs = "/".join(sorted({"on" if r["pd_graphs"] else "off" for r in rows if "pd_graphs" in r})) or "n/a"
    print(f"# planned_diffusion_speedup {args.mode}  torch {torch.__version__}  device {device}  "
          f"PD denoise graphs {graphs}  {time.perf_counter() - start:.0f} s\n{text}")
    if args.out:
        Path(args.out).write_text(json.dumps({"mode": args.mode, "device": device, "argv": sys.argv,
                                              "pd_denoise_graphs": graphs, "rows": rows, "summary": text},
                                             indent=1) + "\n")


if __name__ == "__main__":
    main()
