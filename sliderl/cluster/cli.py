"""The ``sliderl`` command line: ``generate``, ``train``, ``sft``, ``eval`` and ``job-metadata``, each
``[CONFIG] [key=value ...]``.

A subcommand loads its config (a YAML file, or the job's recipe in configs/ when none is given,
then ``key.sub=value`` overrides), prints and saves the resolved config, and runs. ``--help`` lists
every key with the value the recipe gives it. Errors the user causes print one line and exit with
code 2 before anything starts; a training run that cannot continue prints why and exits with code 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import functools
import json
import signal
import sys
import time
from pathlib import Path
from typing import Any

from sliderl.cluster.config.base import (
    GenerateConfig,
    check_device,
    check_outlives_job,
    config_reference,
    load_config,
    save_config,
    to_yaml,
)
from sliderl.cluster.config.sft import SFTJobConfig
from sliderl.cluster.config.train import TrainConfig
from sliderl.cluster.errors import ConfigError
from sliderl.cluster.run import interrupt

RUN_FAILED = 1
USER_ERROR = 2
INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a Ctrl-C
DISPLAY_CHARS = 120


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``sliderl`` console script; returns the exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if hasattr(signal, "SIGUSR1") and sys.__stderr__ is not None:  # `kill -USR1 <pid>`: where a hung job is
        faulthandler.register(signal.SIGUSR1, file=sys.__stderr__, all_threads=True)  # every thread's stack; goes on
    interrupt.install()  # a Ctrl-C that library code swallows is raised again at the driver's next check
    parser = build_parser(_help_request(argv))
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # argparse: --help (0) or a usage error (2), message already printed
        return int(exit_.code or 0)
    try:
        config_path, overrides = split_args(args.args)
        return args.run(config_path, overrides)
    except (ConfigError, ValueError, FileNotFoundError) as err:
        print(f"sliderl {args.command}: error: {' '.join(str(err).split())}", file=sys.stderr)
        return USER_ERROR
    except KeyboardInterrupt:  # Ctrl-C (or a time-boxing SIGINT): the job's own cleanup ran on the way out
        print(f"sliderl {args.command}: interrupted; what it wrote so far (checkpoints, traces, metrics) is kept",
              file=sys.stderr)
        return INTERRUPTED


def _help_request(argv: list[str]) -> tuple[str, str | None, list[str]] | None:
    """``(command, config, overrides)`` when ``argv`` asks a job's ``--help`` with a config file or overrides
    (``sliderl train configs/x.yaml --help``): that help then lists those values, not the default recipe's."""
    if not argv or not {"-h", "--help"} & set(argv[1:]):
        return None
    rest = [a for a in argv[1:] if a not in ("-h", "--help")]
    try:
        path, overrides = split_args(rest)
    except ConfigError:
        return None
    return (argv[0], path, overrides) if path or overrides else None


def build_parser(help_request: tuple[str, str | None, list[str]] | None = None) -> argparse.ArgumentParser:
    """The ``sliderl`` parser; ``help_request`` (``_help_request``) makes that job's help list its config's values."""
    parser = argparse.ArgumentParser(prog="sliderl", description="Bounded-KV rollouts and RL for reasoning models.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    job = functools.partial(_job, help_request=help_request)
    job(commands, "generate", run_generate, GenerateConfig,
         "sample completions with the paged-KV engine and report KV usage",
         "Sample n completions per prompt; write config.yaml and completions.jsonl to output_dir.",
         "engine.kv=full sampling.max_tokens=16")
    job(commands, "train", run_train, TrainConfig, "RL on Ray with bounded-KV rollouts (no arguments: the tiny-arith job)",
         "Train a policy with GRPO/BoNBoN on a local Ray instance or, under `ray job submit` (RAY_ADDRESS set), on "
         "the cluster. Writes config.yaml, traces/, checkpoints/, metrics.jsonl, plots and summary.txt to run_dir. "
         "resume=true continues a run.", "train.steps=5 rollout.num_workers=2")
    job(commands, "sft", run_sft, SFTJobConfig,
         "supervised fine-tuning on prompt/completion pairs (no arguments: the tiny-arith SFT job)",
         "Fine-tune model on (prompt, completion) pairs — the arith task's solutions or a .jsonl/.parquet file "
         "(data.source) of pairs or of chat conversations (a messages column) — with the learner's SFT algorithm under one KV policy (kv). Writes config.yaml and the "
         "checkpoint (model/) to output_dir.", "data.source=pairs.jsonl sft.steps=100")
    metadata = commands.add_parser(
        "job-metadata", help="print a train job's Ray job metadata as JSON (for ray job submit --metadata-json)",
        usage="%(prog)s [-h] [CONFIG] [key=value ...]",
        description="Print the metadata the dashboard's Jobs page shows for `sliderl train CONFIG [key=value ...]` "
                    "(run name and label, run_dir, config, KV policy, model, algorithm, sliderl version and commit) "
                    "as one JSON object. A driver that `sliderl train` starts carries it by itself; a submitted job "
                    "shows the metadata given at submission: ray job submit --metadata-json \"$(sliderl job-metadata "
                    "CONFIG key=value ...)\" -- sliderl train CONFIG key=value ...")
    metadata.add_argument("args", nargs="*", metavar="CONFIG | key=value",
                          help="the same config file and overrides as the train job")
    metadata.set_defaults(run=run_job_metadata)
    evaluate = commands.add_parser(
        "eval", help="score a checkpoint, or compare checkpoints and KV policies, on the task's eval split",
        usage="%(prog)s [-h] CHECKPOINT | COMPARE.yaml [key=value ...]",
        description="sliderl eval CHECKPOINT: greedy accuracy and KV use of CHECKPOINT (a Hugging Face directory, "
                    "e.g. run_dir/checkpoints/step_000120) on eval.num_problems eval problems. The run's "
                    "config.yaml (two folders up) is used when present; overrides apply on top.\n\n"
                    "sliderl eval COMPARE.yaml: every entry of eval.compare.entries (a label, a checkpoint, a KV "
                    "policy) samples eval.compare.k completions per problem (temperature 0.6, top-p 0.95 unless "
                    "set) once per seed in eval.compare.seeds; an entry with budget_of/budgets runs at fractions of "
                    "the named entry's measured mean live KV ({budget} or {budget-N} in its kv, e.g. "
                    "streaming:4:{budget-4}). Prints a table of avg@k, pass@k, mean and peak live KV, tokens, "
                    "aggregate tokens/s and decode seconds, and writes results.md, results.jsonl, config.yaml and "
                    "three Pareto plots (accuracy against live KV, throughput, decode time) to "
                    "eval.compare.output_dir. COMPARE.yaml has the train job's keys (task, data, model, engine, "
                    "sampling, eval); configs/compare-tiny.yaml is an example.",
        epilog=_compare_keys_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    evaluate.add_argument("args", nargs="*", metavar="CHECKPOINT | COMPARE.yaml | key=value",
                          help="the checkpoint directory or a comparison file, then overrides such as "
                               "engine.kv=sliding_window:32 or eval.compare.k=4")
    evaluate.set_defaults(run=run_eval)
    return parser


def _job(commands, name: str, run, schema, summary: str, description: str, example: str,
         help_request: tuple[str, str | None, list[str]] | None = None) -> None:
    """A ``[CONFIG] [key=value ...]`` subcommand whose help lists the keys with the values the job would run:
    the default recipe's, or those of the config file and overrides given beside ``--help``."""
    path, overrides = help_request[1:] if help_request and help_request[0] == name else (None, [])
    job = commands.add_parser(name, help=summary, usage="%(prog)s [-h] [CONFIG] [key=value ...]",
                              description=description, epilog=_keys_help(schema, path, overrides),
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    job.add_argument("args", nargs="*", metavar="CONFIG | key=value",
                     help=f"an optional YAML file (default: configs/{schema.RECIPE}), then overrides such as {example}")
    job.set_defaults(run=run)


def _keys_help(schema, path: str | None = None, overrides: list[str] = ()) -> str:
    """Every key of the job's config (the default recipe, or ``path`` with ``overrides``) with the value the
    job will use and its meaning."""
    source = " ".join([path or f"configs/{schema.RECIPE}", *overrides])
    try:
        lines = config_reference(load_config(schema, path, list(overrides)))
    except (ConfigError, FileNotFoundError) as err:  # a broken recipe must not break --help of the other commands
        lines = [f"(the config does not load: {' '.join(str(err).split())})"]
    return f"config keys, with the values of {source} (override with key=value):\n  " + "\n  ".join(lines)


def _compare_keys_help() -> str:
    """The ``eval.compare`` keys with their defaults and meanings."""
    from sliderl.cluster.config.compare import CompareConfig, CompareEntry

    entry = [f"  eval.compare.entries[].{name}: {' '.join((field.description or '').split())}"
             for name, field in CompareEntry.model_fields.items()]
    keys = [line for line in config_reference(CompareConfig(), "eval.compare.") if not line.startswith("eval.compare.output_dir")]
    return ("comparison keys, with their defaults (override with key=value):\n  " + "\n  ".join(keys)
            + "\n  eval.compare.output_dir = runs/eval-<timestamp>  Where results.md, results.jsonl, config.yaml "
            "and the Pareto plots are written.\n" + "\n".join(entry))


def split_args(args: list[str]) -> tuple[str | None, list[str]]:
    """Separate the optional config path from ``key=value`` overrides (any argument holding ``=``)."""
    paths = [a for a in args if "=" not in a]
    overrides = [a for a in args if "=" in a]
    if len(paths) > 1:
        raise ConfigError(f"expected at most one config file, got {paths}; overrides look like key.sub=value")
    return (paths[0] if paths else None), overrides


# ------------------------------------------------------------------------------------ generate


def run_generate(config_path: str | None, overrides: list[str]) -> int:
    """``sliderl generate``: load the config, generate, print and write the results."""
    from sliderl.cluster.storage.root import check_writable_folder

    cfg = load_config(GenerateConfig, config_path, overrides)
    check_device(cfg.engine.device, "engine.device")
    check_outlives_job(cfg.output_dir, "output_dir")
    check_writable_folder(cfg.output_dir, "output_dir")
    print(to_yaml(cfg), end="", flush=True)
    out_dir = Path(cfg.output_dir)
    save_config(cfg, out_dir / "config.yaml")

    from sliderl.rollout import LLM

    llm = LLM(cfg.model.resolve(), args=cfg.engine)
    prompts = [p for p in cfg.prompts for _ in range(cfg.n)]
    params = [cfg.sampling.for_sample(j) for _ in cfg.prompts for j in range(cfg.n)]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    wall = time.perf_counter() - start

    records = [completion_record(i // cfg.n, i % cfg.n, prompt, out) for i, (prompt, out) in enumerate(zip(prompts, outputs))]
    write_jsonl(out_dir / "completions.jsonl", records)
    summary = summarize(outputs, wall, llm.stats.preemptions)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print_completions(records)
    print_summary(summary, out_dir)
    return 0


def completion_record(prompt_index: int, sample_index: int, prompt: str, out: Any) -> dict[str, Any]:
    """One line of completions.jsonl."""
    return {
        "prompt_index": prompt_index,
        "sample_index": sample_index,
        "prompt": prompt,
        "text": out.text,
        "finish_reason": out.finish_reason,
        "prompt_token_ids": list(out.prompt_token_ids),
        "token_ids": list(out.token_ids),
        "logprobs": list(out.logprobs),
        "num_tokens": len(out.token_ids),
        "peak_visible_kv_tokens": out.kv.peak_visible_tokens,
        "mean_visible_kv_tokens": out.kv.mean_visible_tokens,
        "peak_blocks": out.kv.peak_blocks,
        "kv_deaths": [list(r) for r in out.kv_deaths],
        "kv_token_steps": out.kv.token_steps,
        "restarts": [dataclasses.asdict(r) for r in getattr(out, "restarts", [])],  # last_k / summary
    }


def summarize(outputs: list[Any], wall_seconds: float, preemptions: int) -> dict[str, Any]:
    """Totals over all requests; KV means are over requests, peaks the largest of any request."""
    tokens = sum(len(o.token_ids) for o in outputs)
    return {
        "requests": len(outputs),
        "generated_tokens": tokens,
        "wall_seconds": round(wall_seconds, 3),
        "tokens_per_second": round(tokens / wall_seconds, 1) if wall_seconds > 0 else 0.0,
        "mean_visible_kv_tokens": round(sum(o.kv.mean_visible_tokens for o in outputs) / len(outputs), 1),
        "peak_visible_kv_tokens": max(o.kv.peak_visible_tokens for o in outputs),
        "peak_blocks": max(o.kv.peak_blocks for o in outputs),
        "preemptions": preemptions,
    }


def write_jsonl(path: Path, records: list[dict[str, Any]]) -> None:
    with path.open("w") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")


def print_completions(records: list[dict[str, Any]]) -> None:
    print()
    for r in records:
        text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in r["text"])
        shown = text if len(text) <= DISPLAY_CHARS else text[:DISPLAY_CHARS - 3] + "..."
        print(f"[prompt {r['prompt_index']} sample {r['sample_index']}] {r['finish_reason']:<6} "
              f"{r['num_tokens']:>5} tok | {shown}")


def print_summary(summary: dict[str, Any], out_dir: Path) -> None:
    print()
    width = max(len(k) for k in summary)
    for key, value in summary.items():
        print(f"{key.replace('_', ' '):<{width}}  {value}")
    print(f"\nwrote {out_dir / 'config.yaml'}, {out_dir / 'completions.jsonl'}, {out_dir / 'summary.json'}")


# --------------------------------------------------------------------------------------- train


def run_job_metadata(config_path: str | None, overrides: list[str]) -> int:
    """``sliderl job-metadata``: the train job's Ray job metadata, one JSON object on stdout."""
    from sliderl.cluster.observe.dashboard import job_metadata

    cfg = load_config(TrainConfig, config_path, overrides)
    print(json.dumps(job_metadata(cfg, config_path)))
    return 0


def run_train(config_path: str | None, overrides: list[str]) -> int:
    """``sliderl train``: load the config, run the job, print the summary."""
    from sliderl.cluster.errors import RunError
    from sliderl.cluster.run.driver import train
    from sliderl.cluster.run.plan import prepare

    cfg = load_config(TrainConfig, config_path, overrides)
    plan = prepare(cfg)  # every error a user can cause (data, run_dir, cluster address) comes before the config
    print(to_yaml(cfg), end="", flush=True)
    try:
        result = train(cfg, config_path=config_path, plan=plan)
    except RunError as err:
        print(f"sliderl train: run failed: {' '.join(str(err).split())}", file=sys.stderr)
        return RUN_FAILED
    print()
    print(result.summary, end="")  # it holds the eval before/after lines
    if result.eval_before is not None and result.eval_after is not None:
        before, after = result.eval_before.accuracy, result.eval_after.accuracy
        print(f"  eval change      accuracy {before:.3f} -> {after:.3f} ({100 * (after - before):+.1f} points)")
    why = result.nothing_trained()
    if why is not None:
        print(f"sliderl train: run failed: {why}", file=sys.stderr)
        return RUN_FAILED
    return 0


# ----------------------------------------------------------------------------------------- sft


def run_sft(config_path: str | None, overrides: list[str]) -> int:
    """``sliderl sft``: load the config, fine-tune, print where the checkpoint is."""
    from transformers import AutoConfig

    from sliderl.cluster.config.prompts import prompt_format
    from sliderl.cluster.run.sft_job import keep_fitting_examples, run_sft_job, stage_pairs, written
    from sliderl.cluster.storage.root import check_writable_folder
    from sliderl.core.loader import load_tokenizer

    cfg = load_config(SFTJobConfig, config_path, overrides)
    check_device(cfg.learner.device, "learner.device")
    check_outlives_job(cfg.output_dir, "output_dir")
    pairs = stage_pairs(cfg, cfg.task)  # the data's errors come before the model is built and anything is written
    conversations = any(not isinstance(prompt, str) for prompt, _ in pairs[0])
    model = cfg.model.resolve()
    tokenizer = load_tokenizer(model)
    prompts = prompt_format(cfg.data, cfg.model, tokenizer, conversations)
    examples = tuple(written(prompts, part, cfg.data.source) for part in pairs)
    context = AutoConfig.from_pretrained(model, local_files_only=True).max_position_embeddings
    train, held_out = keep_fitting_examples(examples, tokenizer, context, cfg.data.skip_invalid, cfg.data.source)
    check_writable_folder(cfg.output_dir, "output_dir")
    print(to_yaml(cfg), end="", flush=True)
    save_config(cfg, Path(cfg.output_dir) / "config.yaml")
    result = run_sft_job(cfg, train, held_out)
    print(f"\n{result.line()}\nwrote {Path(cfg.output_dir) / 'config.yaml'} and the checkpoint {result.path}")
    return 0


# ---------------------------------------------------------------------------------------- eval


def run_eval(target: str | None, overrides: list[str]) -> int:
    """``sliderl eval CHECKPOINT`` or ``sliderl eval COMPARE.yaml``."""
    if target is not None and (Path(target).expanduser().is_file() or Path(target).suffix in (".yaml", ".yml")):
        return run_compare(target, overrides)
    return run_checkpoint_eval(target, overrides)


def checked_checkpoint(checkpoint: str, key: str = "checkpoint") -> Path:
    """``checkpoint`` as a path, refused (ConfigError) unless it is an intact Hugging Face directory."""
    from sliderl.trainer.manifest import check_intact

    path = Path(checkpoint).expanduser()
    if not (path / "config.json").is_file():
        raise ConfigError(f"{key} {checkpoint!r} is not a Hugging Face model directory (no config.json)")
    try:
        check_intact(path)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    return path


def eval_problems(cfg: TrainConfig) -> list:
    """The first eval.num_problems problems of the config's eval split (prompts: the problem texts, not yet written
    by ``cluster.config.prompts.PromptFormat``)."""
    import tempfile

    from sliderl.cluster.storage.data import data_sources, load_split

    with tempfile.TemporaryDirectory() as scratch:
        _, eval_source = data_sources(cfg, scratch)
        return load_split(cfg, eval_source, cfg.eval.num_problems)


def run_checkpoint_eval(checkpoint: str | None, overrides: list[str]) -> int:
    """``sliderl eval CHECKPOINT``: accuracy and KV numbers of a checkpoint on the eval split, its prompts
    written by the run's ``data`` settings with the checkpoint's tokenizer."""
    from sliderl.cluster.config.prompts import prompt_format
    from sliderl.cluster.eval.evaluation import score
    from sliderl.core.loader import load_tokenizer
    from sliderl.rollout import LLM

    if checkpoint is None:
        raise ConfigError("sliderl eval needs a CHECKPOINT directory (e.g. runs/x/checkpoints/step_000120) "
                          "or a COMPARE.yaml file (e.g. configs/compare-tiny.yaml)")
    if any(o.startswith("eval.compare.") or o.startswith("eval.compare=") for o in overrides):
        raise ConfigError("eval.compare.* settings belong to a comparison: sliderl eval COMPARE.yaml [key=value ...]")
    path = checked_checkpoint(checkpoint)
    run_config = path.resolve().parent.parent / "config.yaml"
    cfg = load_config(TrainConfig, str(run_config) if run_config.is_file() else None, overrides)
    problems = prompt_format(cfg.data, cfg.model, load_tokenizer(path)).apply(eval_problems(cfg))
    check_device(cfg.engine.device, "engine.device")
    llm = LLM(str(path), args=cfg.engine)
    start = time.perf_counter()
    outputs = llm.generate([p.engine_prompt for p in problems], cfg.eval_sampling())
    result = score(outputs, problems, cfg.verifier(), cfg.engine.kv)
    print(f"{path}: {result.line()} | {time.perf_counter() - start:.1f} s")
    print(json.dumps({"checkpoint": str(path), **result.__dict__}))
    return 0


def run_compare(config_path: str, overrides: list[str]) -> int:
    """``sliderl eval COMPARE.yaml``: every entry of eval.compare sampled k times per problem; table and plots."""
    from sliderl.cluster.eval.comparison import run_comparison
    from sliderl.cluster.eval.report import text_table, write_report, write_tables
    from sliderl.cluster.storage.root import check_writable_folder

    cfg = load_config(TrainConfig, config_path, overrides)
    compare = cfg.eval.compare
    if not compare.entries:
        raise ConfigError(f"{config_path} lists no eval.compare.entries; give each a label, a checkpoint and a kv "
                          "policy (sliderl eval --help)")
    check_device(cfg.engine.device, "engine.device")
    check_outlives_job(compare.output_dir, "eval.compare.output_dir")
    check_writable_folder(compare.output_dir, "eval.compare.output_dir")
    checkpoints = {e.label: str(checked_checkpoint(e.checkpoint, f"entry {e.label!r}: checkpoint")
                                if e.checkpoint is not None else cfg.model.resolve()) for e in compare.entries}
    problems = eval_problems(cfg)
    print(to_yaml(cfg), end="", flush=True)
    out_dir = Path(compare.output_dir)
    save_config(cfg, out_dir / "config.yaml")
    finished = []

    def report(r) -> None:  # each finished entry is on disk at once: a comparison cut short keeps its rows
        print(f"sliderl eval: {r.label} ({r.kv}): avg@k {r.mean('avg_at_k'):.3f}, mean live KV "
              f"{r.mean('mean_live_kv'):.1f}, mean critical path {r.mean('mean_critical_path'):.1f} tokens", flush=True)
        finished.append(r)
        write_tables(finished, out_dir)

    results = run_comparison(cfg, checkpoints, problems, cfg.verifier(), report=report)
    written = write_report(results, out_dir)
    print(f"\n{len(problems)} problems x k={compare.k}, seeds {list(compare.seeds)}, temperature "
          f"{compare.temperature}, top-p {compare.top_p}\n")
    print(text_table(results), end="")
    print(f"\nwrote {out_dir / 'config.yaml'}, " + ", ".join(str(p) for p in written))
    return 0


if __name__ == "__main__":
    sys.exit(main())
