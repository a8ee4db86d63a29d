"""Pasta's realised speedup at batch size 1 against its theoretical speedup (issue 14, "Realised speedup").

    python benchmarks/pasta_speedup.py scripted [--device cuda] [--problems 8] [--repeats 5] [--out F]
    python benchmarks/pasta_speedup.py trained --pasta-model runs/pasta-sft/model --baseline-model runs/pasta-base/model

One request at a time. *Realised* speedup = wall-clock of the sequential response decoded by the same
engine under ``kv="full"`` ÷ wall-clock of the Pasta response decoded under ``kv="pasta"`` (its forks
decoded as threads beside the main thread, in one batch). *Theoretical* speedup = the sequential
response's tokens ÷ the Pasta response's critical path (``core.pasta.PastaLayout.critical_path``:
a step per main-thread token, a fork's block runs beside the main thread from its ``/>``, a ``<sync/>``
waits for its forks). The target is realised ≥ 80% of theoretical.

- ``scripted``: a Qwen3 with random weights — the 1.7B config in bf16 on CUDA, a tiny config in fp32 on
  CPU — is teacher-forced (``LLM.force``) through held-out problems of the summed-chains task
  (``tasks.pasta``): each thread of the Pasta engine takes its part of the annotated solution,
  the full engine takes the plain solution, each followed by eos. The outputs are checked to be exactly
  those responses, so both engines do the work the theory counts.
- ``trained``: held-out problems (the task's eval split) generated greedily by a Pasta-SFT checkpoint
  under ``kv="pasta"`` and by a Baseline-SFT checkpoint under ``kv="full"`` (``sliderl sft
  configs/pasta-sft.yaml ...``); the task and prompt format come from the Pasta run's config.yaml.
  Theoretical = Baseline-SFT's response length ÷ the Pasta response's critical path (the issue's
  definition); the final eos is not counted in either.

Each request runs once untimed (graph captures, compiles), then ``--repeats`` times per engine,
interleaved; the median wall time counts (request added to finished, synchronised); ``--cpu-time``
counts the process's CPU time instead (a shared CPU machine: other jobs' load then does not count). Both
engines run with their defaults — on CUDA, each decode step queued before the previous one's tokens are
read back (``overlap``; under pasta a fork then starts, and a join happens, a step later) — and, on CUDA,
both again with ``overlap=False`` ("serial" columns). ``--host-profile N`` adds a cProfile of the pasta
engine over N requests (own time per function).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from sliderl.core.pasta import PASTA_TOKENS, PastaLayout, PastaTokenIds  # noqa: E402
from sliderl.rollout import LLM, SamplingParams  # noqa: E402
from sliderl.rollout.sequence import Status  # noqa: E402

TINY = dict(hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=512)  # CPU model


@dataclass
class Trace:
    """One problem: its prompt and, for the scripted mode, the two responses to force (no eos)."""

    name: str
    prompt: list[int]
    annotated: list[int] = field(default_factory=list)
    plain: list[int] = field(default_factory=list)
    answer: str = ""


@dataclass
class Row:
    """One problem's measurement; times are medians in seconds."""

    name: str
    forks: int
    plain_tokens: int  # the sequential response (Baseline-SFT's, trained mode), eos not counted
    pasta_tokens: int  # the flattened Pasta response, eos not counted
    critical_path: int
    pasta_steps: int  # engine steps the pasta request ran (``PastaOutput.steps``)
    plain_steps: int
    theoretical: float
    pasta_s: float
    full_s: float
    pasta_serial_s: float | None = None  # both engines with overlap off (CUDA only)
    full_serial_s: float | None = None
    pasta_serial_steps: int | None = None
    correct: tuple[bool, bool] | None = None  # trained: (Pasta-SFT, Baseline-SFT) answers right

    @property
    def realised(self) -> float:
        return self.full_s / self.pasta_s

    @property
    def realised_serial(self) -> float | None:
        return None if self.full_serial_s is None else self.full_serial_s / self.pasta_serial_s


# ---- responses as thread scripts ----------------------------------------------------------------------
def thread_scripts(layout: PastaLayout, ids: list[int], eos: int) -> dict[int, list[int]]:
    """What each thread of the Pasta runtime samples to write ``ids`` (a flattened completion): the main thread
    its tokens and eos, fork k its block after the ``<async>`` the runtime inserts."""
    thread = layout.thread.tolist()[layout.prompt_len:]
    scripts = {0: [t for t, th in zip(ids, thread) if th == 0] + [eos]}
    for k, fork in enumerate(layout.forks, start=1):
        scripts[k] = ids[fork.block[0] + 1 - layout.prompt_len:fork.block[1] - layout.prompt_len]
    return scripts


def layout_of(llm: LLM, prompt_len: int, ids: list[int]) -> PastaLayout:
    tags = PastaTokenIds.from_tokenizer(llm.tokenizer)
    return PastaLayout.parse(prompt_len, ids, tags, llm.tokenizer.decode)


def without_eos(ids: list[int], eos: set[int]) -> list[int]:
    return ids[:-1] if ids and ids[-1] in eos else ids


def theoretical_speedup(llm: LLM, trace: Trace) -> tuple[float, PastaLayout]:
    """Plain tokens ÷ the annotated response's critical path (``PastaLayout``)."""
    layout = layout_of(llm, len(trace.prompt), trace.annotated)
    return layout.speedup(len(trace.plain)), layout


# ---- timing ----------------------------------------------------------------------------------------------
def synchronize(llm: LLM) -> None:
    if llm.device.type == "cuda":
        torch.cuda.synchronize(llm.device)


def timed_request(llm: LLM, prompt: list[int], params: SamplingParams, scripts: dict[int, list[int]] | None = None,
                  clock=time.perf_counter, profile=None):
    """Run one request alone; (``clock`` seconds from add_request to finished, its output, engine steps).
    ``profile``: a ``cProfile.Profile`` enabled over the steps."""
    gc.collect()
    synchronize(llm)
    steps, t0 = llm.stats.steps, clock()
    seq = llm.add_request(prompt, params)
    for thread, tokens in (scripts or {}).items():
        llm.force(seq, tokens, thread)
    profile and profile.enable()
    while seq.status is not Status.FINISHED:
        llm.step()
    synchronize(llm)
    profile and profile.disable()
    return clock() - t0, llm.output(seq), llm.stats.steps - steps


def measure(engines: dict[str, LLM], jobs: dict[str, tuple], repeats: int,
            clock=time.perf_counter) -> tuple[dict[str, float], dict]:
    """Median seconds of each engine's job (prompt, params, scripts) after one untimed run, the runs
    interleaved; and each engine's output and steps from its last run."""
    times: dict[str, list[float]] = {name: [] for name in engines}
    last = {}
    for r in range(repeats + 1):
        for name, llm in engines.items():
            seconds, out, steps = timed_request(llm, *jobs[name], clock=clock)
            if r:
                times[name].append(seconds)
            last[name] = (out, steps)
    return {name: statistics.median(t) for name, t in times.items()}, last


def engine_args(device: str, max_model_len: int, max_forks: int) -> dict:
    """Batch-1 engines: a pool for one request with every fork at full length, CUDA graphs up to 16 rows."""
    dtype = "bfloat16" if device.startswith("cuda") else "float32"
    blocks = (max_forks + 1) * (max_model_len // 16 + 3)
    return dict(device=device, dtype=dtype, block_size=16, num_blocks=blocks, max_model_len=max_model_len,
                max_num_seqs=16, pasta_max_forks=max_forks)


def engines_for(pasta: str | Path, full: str | Path, args: dict) -> dict[str, LLM]:
    """The pasta and full engines with their defaults and, on CUDA, both again with overlap off."""
    engines = {"pasta": LLM(str(pasta), kv="pasta", **args), "full": LLM(str(full), kv="full", **args)}
    if args["device"].startswith("cuda"):
        engines["pasta_serial"] = LLM(str(pasta), kv="pasta", overlap=False, **args)
        engines["full_serial"] = LLM(str(full), kv="full", overlap=False, **args)
    return engines


def scripted_engines(path: Path, device: str, max_model_len: int, max_forks: int) -> dict[str, LLM]:
    return engines_for(path, path, engine_args(device, max_model_len, max_forks))


def clock_of(args):
    return time.process_time if args.cpu_time else time.perf_counter


# ---- the two modes ----------------------------------------------------------------------------------------
def build_model(root: Path, device: str, tiny: dict) -> Path:
    """CUDA: the Qwen3-1.7B config, random bf16 weights; CPU: a tiny Qwen3. Both with the Pasta-Lang tokens."""
    if device.startswith("cuda"):
        from sliderl.core.tiny import make_qwen3_1p7b
        return make_qwen3_1p7b(root / "qwen3-1.7b-pasta", device=device, extra_special_tokens=PASTA_TOKENS)
    from sliderl.core.tiny import make_tiny_model
    return make_tiny_model(root / "tiny-pasta", "qwen3", extra_special_tokens=PASTA_TOKENS, **tiny)


def task_traces(tokenizer, n: int, num_chains: tuple[int, int], num_steps: tuple[int, int], seed: int) -> list[Trace]:
    """The first ``n`` problems of the summed-chains task's eval split (held out from every training split)."""
    from sliderl.tasks.pasta import PastaTask
    task = PastaTask(num_chains=num_chains, num_steps=num_steps, seed=seed)
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    return [Trace(p["prompt_id"], encode(p["prompt"]), encode(p["solution"]), encode(p["solution_plain"]), p["answer"])
            for p in task.problems(n, "eval")]


def run_scripted(args) -> tuple[list[Row], list[dict]]:
    """The scripted rows, and the problems they timed."""
    device = args.device
    with tempfile.TemporaryDirectory() as tmp:
        tiny = {**TINY, "hidden_size": args.hidden_size or TINY["hidden_size"],
                "num_layers": args.layers or TINY["num_layers"]}
        path = build_model(Path(tmp), device, tiny)
        from sliderl.core.loader import load_tokenizer
        seed = 0 if args.task_seed is None else args.task_seed
        traces = task_traces(load_tokenizer(path), args.problems, tuple(args.num_chains), tuple(args.num_steps), seed)
        longest = max(len(t.prompt) + max(len(t.annotated), len(t.plain)) for t in traces)
        engines = scripted_engines(path, device, max_model_len=2 * longest + 64, max_forks=args.num_chains[1])
        rows = [scripted_row(engines, trace, args.repeats, clock_of(args)) for trace in traces]
        if args.host_profile:
            print(host_profile(engines["pasta"], traces, args.host_profile))
        for llm in engines.values():
            llm.close()
    return rows, [{"prompt_id": t.name, "task_seed": seed} for t in traces]


def scripted_row(engines: dict[str, LLM], trace: Trace, repeats: int, clock=time.perf_counter) -> Row:
    pasta = engines["pasta"]
    eos = pasta.tokenizer.eos_token_id
    theory, layout = theoretical_speedup(pasta, trace)
    params = SamplingParams(max_tokens=len(trace.annotated) + 1, temperature=0.0)
    scripts = thread_scripts(layout, trace.annotated, eos)
    jobs = {name: (trace.prompt, params, scripts if name.startswith("pasta") else {0: trace.plain + [eos]})
            for name in engines}
    times, last = measure(engines, jobs, repeats, clock)
    for name, (out, _) in last.items():
        want = (trace.annotated if name.startswith("pasta") else trace.plain) + [eos]
        if out.token_ids != want:
            raise RuntimeError(f"{trace.name}: the {name} engine did not write the forced response")
    return Row(trace.name, len(layout.forks), len(trace.plain), len(trace.annotated), layout.critical_path,
               last["pasta"][0].pasta.steps, last["full"][1], theory, *serial_times(times, last))


def serial_times(times: dict[str, float], last: dict) -> tuple:
    """(pasta_s, full_s, pasta_serial_s, full_serial_s, pasta_serial_steps) of ``measure``'s results."""
    serial = "pasta_serial" in times
    return (times["pasta"], times["full"], times.get("pasta_serial"), times.get("full_serial"),
            last["pasta_serial"][0].pasta.steps if serial else None)


def run_trained(args) -> tuple[list[Row], list[dict]]:
    """Held-out problems (the eval split of the config's task, or of ``--task-seed``'s), Pasta-SFT under kv=pasta
    against Baseline-SFT under kv=full, greedy; the rows and the problems they timed."""
    from sliderl.cluster.config.base import load_config
    from sliderl.cluster.config.prompts import prompt_format
    from sliderl.cluster.config.sft import SFTJobConfig
    from sliderl.rewards.arith import ArithVerifier

    config = args.config or Path(args.pasta_model).resolve().parent / "config.yaml"
    cfg = load_config(SFTJobConfig, str(config))
    if cfg.task.type != "pasta":
        raise SystemExit(f"{config}: task.type={cfg.task.type}, expected pasta (the summed-chains task)")
    engines = engines_for(args.pasta_model, args.baseline_model,
                          engine_args(args.device, args.max_model_len, args.max_forks))
    prompts = prompt_format(cfg.data, cfg.model, engines["pasta"].tokenizer)
    verify = ArithVerifier()
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    task = cfg.task if args.task_seed is None else dataclasses.replace(cfg.task, seed=args.task_seed)
    rows, problems = [], []
    for p in task.generator().problems(args.problems, "eval"):
        problems.append({"prompt_id": p["prompt_id"], "task_seed": task.seed, "prompt": p["prompt"]})
        _, ids = prompts.problem(p["prompt"])
        jobs = {name: (ids, params, None) for name in engines}
        times, last = measure(engines, jobs, args.repeats, clock_of(args))
        (out, _), (base_out, base_steps) = last["pasta"], last["full"]
        flat = without_eos(out.token_ids, engines["pasta"].eos_ids)
        plain = without_eos(base_out.token_ids, engines["full"].eos_ids)
        layout = layout_of(engines["pasta"], len(ids), flat)
        correct = (verify(out.text, p["answer"]).total == 1.0, verify(base_out.text, p["answer"]).total == 1.0)
        rows.append(Row(p["prompt_id"], len(layout.forks), len(plain), len(flat), layout.critical_path, out.pasta.steps,
                        base_steps, layout.speedup(len(plain)), *serial_times(times, last), correct))
        print(json.dumps({**asdict(rows[-1]), "realised": rows[-1].realised}), flush=True)  # kept if cut short
    for llm in engines.values():
        llm.close()
    return rows, problems


def host_profile(llm: LLM, traces: list[Trace], n: int, top: int = 15) -> str:
    """cProfile of ``n`` scripted pasta requests: the functions with the most own time, per engine step."""
    import cProfile
    import pstats
    prof, steps = cProfile.Profile(), 0
    eos = llm.tokenizer.eos_token_id
    for trace in (traces * n)[:n]:
        layout = layout_of(llm, len(trace.prompt), trace.annotated)
        params = SamplingParams(max_tokens=len(trace.annotated) + 1, temperature=0.0)
        steps += timed_request(llm, trace.prompt, params, thread_scripts(layout, trace.annotated, eos), profile=prof)[2]
    rows = sorted(pstats.Stats(prof).stats.items(), key=lambda kv: -kv[1][2])[:top]
    lines = [f"host profile of the pasta engine over {n} requests ({steps} steps), per step:"]
    lines += [f"{1e3 * tt / steps:7.3f} ms own {1e3 * ct / steps:7.3f} cum  {Path(f).name}:{line} {name} "
              f"x{nc / steps:.1f}" for (f, line, name), (_, nc, tt, ct, _) in rows]
    return "\n".join(lines)


# ---- report ----------------------------------------------------------------------------------------------
def geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def table(rows: list[Row]) -> str:
    """One line per problem: sizes, steps, theoretical speedup, ms per engine step (pasta / full), realised
    speedup and its ratio to the theoretical; "serial": both engines with overlap off."""
    serial = rows[0].full_serial_s is not None
    head = (f"{'problem':<18} forks plain pasta  path steps  theory  ms/step pasta  full   realised ratio"
            + ("   serial: steps ms/step pasta  full  realised ratio" if serial else ""))
    lines = [head]
    for r in rows:
        line = (f"{r.name:<18} {r.forks:>5} {r.plain_tokens:>5} {r.pasta_tokens:>5} {r.critical_path:>5} "
                f"{r.pasta_steps:>5} {r.theoretical:>7.3f}  {1e3 * r.pasta_s / r.pasta_steps:>13.2f} "
                f"{1e3 * r.full_s / r.plain_steps:>5.2f}   {r.realised:>8.3f} {r.realised / r.theoretical:>5.2f}")
        if serial:
            line += (f"   {r.pasta_serial_steps:>13} {1e3 * r.pasta_serial_s / r.pasta_serial_steps:>13.2f} "
                     f"{1e3 * r.full_serial_s / r.plain_steps:>5.2f}  {r.realised_serial:>8.3f} "
                     f"{r.realised_serial / r.theoretical:>5.2f}")
        if r.correct is not None:
            line += f"   correct pasta/base {int(r.correct[0])}/{int(r.correct[1])}"
        lines.append(line)
    s = summary(rows)
    line = (f"geometric mean over {len(rows)}: theoretical {s['theoretical']:.3f}, realised {s['realised']:.3f} "
            f"(ratio {s['ratio']:.2f})")
    if serial:
        line += f"; serial: realised {s['realised_serial']:.3f} (ratio {s['ratio_serial']:.2f})"
    return "\n".join([*lines, line])


def summary(rows: list[Row]) -> dict:
    out = {"theoretical": geomean([r.theoretical for r in rows]), "realised": geomean([r.realised for r in rows])}
    out["ratio"] = out["realised"] / out["theoretical"]
    if rows[0].full_serial_s is not None:
        out["realised_serial"] = geomean([r.realised_serial for r in rows])
        out["ratio_serial"] = out["realised_serial"] / out["theoretical"]
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["scripted", "trained"])
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--problems", type=int, default=8, help="held-out problems (the task's eval split)")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per problem and engine (median)")
    parser.add_argument("--num-chains", type=int, nargs=2, default=[2, 4], help="scripted: the task's chains")
    parser.add_argument("--num-steps", type=int, nargs=2, default=[5, 6],
                        help="scripted: the task's steps per chain (most chains x most steps <= 26 step letters)")
    parser.add_argument("--task-seed", type=int, default=None,
                        help="the task's seed, whose eval split gives the problems (scripted: 0; trained: the "
                             "config's, so a slice the recipe never scored is --task-seed 1)")
    parser.add_argument("--hidden-size", type=int, default=None, help=f"scripted, CPU: width ({TINY['hidden_size']})")
    parser.add_argument("--layers", type=int, default=None, help=f"scripted, CPU: tiny depth ({TINY['num_layers']})")
    parser.add_argument("--host-profile", type=int, default=0, metavar="N", help="scripted: cProfile N pasta requests")
    parser.add_argument("--cpu-time", action="store_true", help="time by process CPU time, not wall-clock")
    parser.add_argument("--pasta-model", help="trained: the Pasta-SFT checkpoint (sliderl sft's output_dir/model)")
    parser.add_argument("--baseline-model", help="trained: the Baseline-SFT checkpoint")
    parser.add_argument("--config", type=Path, default=None,
                        help="trained: the Pasta run's config.yaml (default: next to --pasta-model)")
    parser.add_argument("--max-tokens", type=int, default=512, help="trained: most generated tokens per thread")
    parser.add_argument("--max-model-len", type=int, default=1024, help="trained: the engines' max_model_len")
    parser.add_argument("--max-forks", type=int, default=8, help="trained: pasta_max_forks")
    parser.add_argument("--out", type=Path, default=None, help="write the rows and the summary as JSON here")
    args = parser.parse_args(argv)
    if args.mode == "trained" and not (args.pasta_model and args.baseline_model):
        parser.error("trained needs --pasta-model and --baseline-model")
    t0 = time.perf_counter()
    rows, problems = run_scripted(args) if args.mode == "scripted" else run_trained(args)
    print(f"# pasta_speedup {args.mode}  {time.strftime('%Y-%m-%d %H:%M')}  torch {torch.__version__}  device "
          f"{torch.cuda.get_device_name(args.device) if args.device.startswith('cuda') else 'cpu'}  "
          f"{time.perf_counter() - t0:.0f} s")
    print(table(rows))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                        "problems": problems, "summary": summary(rows),
                                        "rows": [{**asdict(r), "realised": r.realised} for r in rows]}, indent=1))


if __name__ == "__main__":
    main()
