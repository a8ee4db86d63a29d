"""SFT stages: ``Learner`` with the SFT algorithm on (prompt, completion) pairs, stopping at a held-out target.

Each ``SFTExample`` becomes a ``Trace`` stamped with the stage's KV policy (prompt ids = the example's
own ``prompt_token_ids`` when it has them — a chat-templated prompt — else ``tokenizer(prompt).input_ids``;
completion ids = the completion's ids without special tokens + ``[eos]``; no sampler logprobs), so the SFT forward
sees exactly what the engine will let the model see. Step s trains on examples ``s·B .. (s+1)·B - 1`` (cycling); every ``check_every`` steps the held-out
examples are scored by ``Learner.evaluate`` and training stops once their exact match (greedy
decoding reproduces the completion) reaches ``target_accuracy``.

A ``pasta`` stage trains Pasta-Lang-annotated completions under Pasta-SFT's modifications (the
threads' mask, position ids and in-thread targets: ``core.pasta``; it needs ``window_mode='full'``)
and adds the tags to the vocabulary first; Baseline-SFT is the same stage under ``full`` on the
completions without annotations (``tasks.pasta`` generates both). A ``planned_diffusion`` stage trains
span-annotated completions (``core.planned_diffusion``) with the algorithm of that name (the hybrid objective).

``run_sft`` writes the checkpoint (Hugging Face layout + ``trainer_state.pt``) to ``out_dir`` and the
marker ``sft.json`` (settings, steps run, checks, losses, seconds) last. ``cached_sft`` trains into a
staging folder and renames it to ``cache_dir/sft-<fingerprint>`` atomically; a folder with its
marker is a finished checkpoint for exactly those inputs, returned without training; so is one bundled with
sliderl under ``BUNDLED`` (the default job's warm start: ``cluster.run.bundle``), copied into the cache first.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from sliderl.core.kv_policy import KVPolicy
from sliderl.core.restart import SummaryTool, written_restarts
from sliderl.core.trace import Trace
from sliderl.core.vocab import policy_tokens
from sliderl.trainer.algorithms import RECORD_CONFIG, require_field
from sliderl.trainer.learner import Learner
from sliderl.trainer.learner_args import LearnerArgs

SFT_ALGORITHMS = ("sft", "planned_diffusion")  # algorithms that train on (prompt, completion) pairs alone
MARKER = "sft.json"
MODEL_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json")
WEIGHT_SUFFIXES = (".safetensors", ".bin")
BUNDLED = Path(__file__).resolve().parents[1] / "assets" / "warmstart"  # finished checkpoints shipped with sliderl


@dataclass(frozen=True)
class SFTExample:
    """One supervised pair: the model learns ``completion`` (then eos) after ``prompt``.

    ``prompt_token_ids``, when given, are the prompt's ids exactly as the engine will receive them (a chat
    template's ids, which tokenizing ``prompt`` again could change, e.g. by a second BOS).
    """

    prompt: str
    completion: str
    prompt_token_ids: tuple[int, ...] | None = None


@dataclass(frozen=True)
class SFTArgs:
    """How long an SFT stage trains and when it stops (the optimizer's settings are ``LearnerArgs``)."""

    __pydantic_config__: ClassVar[dict] = RECORD_CONFIG
    steps: int = 1500
    """Most optimizer steps (>= 1); fewer when the target accuracy is reached first."""
    batch_size: int = 16
    """Examples per step (>= 1)."""
    check_every: int = 25
    """Steps between held-out checks (>= 1), when there are held-out examples."""
    target_accuracy: float = 0.0
    """Stop at the first check whose held-out exact match reaches this, in [0, 1]; 0 trains all steps."""
    log_every: int = 0
    """Print the loss every this many steps (>= 0; 0: silent). Does not change the weights."""
    max_seconds: float = 0.0
    """Stop at the first step boundary this many wall seconds after the stage started (>= 0; 0: no limit); write
    the checkpoint as at the end; a time-boxed stage (the lr schedule still spans ``steps``)."""
    summary_tool: SummaryTool = SummaryTool()
    """kv=summary:N:S: the tool call the completions write (``core.restart.SummaryTool``, the engine's
    ``summary_tool``): each call in a completion restarts its context there, as the engine does."""

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "check_every"):
            require_field(self, name, getattr(self, name) >= 1, ">= 1")
        require_field(self, "target_accuracy", 0 <= self.target_accuracy <= 1, "in [0, 1] (0: train all steps)")
        require_field(self, "log_every", self.log_every >= 0, ">= 0")
        require_field(self, "max_seconds", self.max_seconds >= 0, ">= 0 (0: no limit)")
        if isinstance(self.summary_tool, dict):
            object.__setattr__(self, "summary_tool", SummaryTool(**self.summary_tool))


@dataclass(frozen=True)
class SFTResult:
    """A finished SFT stage: where the checkpoint is and how training went (also the marker's content)."""

    path: str  # the checkpoint directory
    steps_run: int
    held_out_accuracy: float | None  # exact match at the last check; None without checks
    checks: list[tuple[int, float]]  # (step, held-out exact match)
    losses: list[float]  # one per step
    seconds: float
    cpu_seconds: float

    def line(self) -> str:
        """One line for a console: steps, loss first -> last, held-out exact match, time."""
        held = "n/a" if self.held_out_accuracy is None else f"{self.held_out_accuracy:.3f}"
        loss = f"{self.losses[0]:.4f} -> {self.losses[-1]:.4f}" if self.losses else "n/a"
        return (f"sft: {self.steps_run} steps | loss {loss} | held-out exact match {held} | "
                f"{self.seconds:.0f} s ({self.cpu_seconds:.0f} cpu-s)")


def sft_trace(tokenizer, example: SFTExample, kv_policy: str, index: int,
              summary_tool: SummaryTool = SummaryTool()) -> Trace:
    """``example`` as a Trace under ``kv_policy``: completion + eos, no sampler logprobs; under a restart policy
    with the restarts the engine would make generating it (``core.restart.written_restarts``)."""
    prompt = tokenizer(example.prompt).input_ids if example.prompt_token_ids is None else list(example.prompt_token_ids)
    # the completion continues the prompt: no BOS of its own, whatever the tokenizer adds to a text
    completion = tokenizer(example.completion, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
    policy = KVPolicy.parse(kv_policy)
    tokens = summary_tool.bind(tokenizer) if policy.kind == "summary" else None
    restarts = written_restarts(policy, prompt, completion, tokens) if policy.restarts else []
    return Trace(f"sft-{index}", f"sft-{index}", str(index), -1, 0, kv_policy, prompt, completion, [], "stop",
                 restarts=restarts)


def policy_specs(kv_policy: str | Sequence[str]) -> list[str]:
    """The stage's policies in canonical form: one, or several (example i trains under the i-th mod their number).
    ValueError for none, or for two that add different tokens to the vocabulary (only one set can join it before
    the examples are tokenized)."""
    specs = [kv_policy] if isinstance(kv_policy, str) else list(kv_policy)
    if not specs:
        raise ValueError("kv=[] names no policy; give one (e.g. prefix_sliding:512) or several")
    specs = [KVPolicy.parse(spec).spec for spec in specs]
    with_tokens = sorted({s for s in specs if policy_tokens(s)})
    if len(with_tokens) > 1:
        raise ValueError(f"kv={specs}: {' and '.join(with_tokens)} each add their own tokens to the vocabulary; "
                         "an SFT stage can take one of them (mixed with policies that add none, e.g. full)")
    return specs


def policy_record(specs: list[str]) -> str | list[str]:
    """How sft.json and the cache key write the policies: one as its spec (as before lists were allowed), several
    as the list."""
    return specs[0] if len(specs) == 1 else specs


def vocab_spec(specs: list[str]) -> str:
    """The policy whose tokens join the vocabulary: the one that has any (registers, pasta), else the first."""
    return next((s for s in specs if policy_tokens(s)), specs[0])


def run_sft(model_path: str | Path, out_dir: str | Path, train_examples: list[SFTExample],
            held_out_examples: list[SFTExample], kv_policy: str | Sequence[str], learner_args: LearnerArgs,
            sft_args: SFTArgs) -> SFTResult:
    """Train ``model_path`` on ``train_examples`` under ``kv_policy``; write the checkpoint and marker to ``out_dir``.

    ``kv_policy``: one policy, or several: then example i (train and held-out alike) is trained and checked under
    the (i mod n)-th, so that one model learns to decode under each (e.g. [prefix_sliding:512, full]).

    learner_args: its ``algo`` must be ``SFTOptions``, or ``PlannedDiffusionOptions`` for span-annotated data (use
    ``window_mode='full'`` to put the loss on every completion token; a cosine ``lr_schedule`` needs ``total_steps``,
    e.g. ``sft_args.steps``).
    """
    if learner_args.algo.type not in SFT_ALGORITHMS:
        raise ValueError(f"learner_args.algo must be SFTOptions (or PlannedDiffusionOptions, the hybrid objective) for "
                         f"an SFT stage, got type {learner_args.algo.type!r}")
    if not train_examples:
        raise ValueError("an SFT stage needs at least one training example")
    if sft_args.target_accuracy > 0 and not held_out_examples:
        raise ValueError(f"target_accuracy={sft_args.target_accuracy} needs held-out examples to check; "
                         "give some or set target_accuracy=0")
    specs = policy_specs(kv_policy)
    t0, cpu0 = time.perf_counter(), time.process_time()
    # the stage's policy tokens (registers:N's <reg_i>) join the vocabulary before the examples are
    # tokenized, so "<reg_3>" in a completion is one token, the one the engine acts on
    learner = Learner(str(model_path), learner_args if learner_args.vocab_policy else
                      dataclasses.replace(learner_args, vocab_policy=vocab_spec(specs)))
    tool = sft_args.summary_tool
    # training examples are tokenized when their step first needs them: a stage that stops at its target reads
    # only part of a long list (the default job's warm start: 675 of 1,500 steps' 24,000 examples)
    @functools.cache
    def train_trace(i: int) -> Trace:
        return sft_trace(learner.tokenizer, train_examples[i], specs[i % len(specs)], i, tool)

    held_out = [sft_trace(learner.tokenizer, e, specs[i % len(specs)], -1 - i, tool)
                for i, e in enumerate(held_out_examples)]
    losses, checks = [], []
    for step in range(1, sft_args.steps + 1):
        first = (step - 1) * sft_args.batch_size
        batch = [train_trace((first + j) % len(train_examples)) for j in range(sft_args.batch_size)]
        losses.append(round(learner.step([batch]).loss, 5))
        if held_out and step % sft_args.check_every == 0:
            checks.append((step, learner.evaluate([held_out]).exact_match))
        reached = sft_args.target_accuracy > 0 and bool(checks) and checks[-1][0] == step \
            and checks[-1][1] >= sft_args.target_accuracy
        if sft_args.log_every and (step % sft_args.log_every == 0 or step in (1, sft_args.steps) or reached):
            accuracy = f"  held-out exact match {checks[-1][1]:.2f}" if checks else ""
            print(f"sft step {step}/{sft_args.steps}  loss {losses[-1]:.4f}{accuracy}  "
                  f"{time.perf_counter() - t0:.0f}s ({time.process_time() - cpu0:.0f} cpu-s)", flush=True)
        if reached:
            break
        elapsed = time.perf_counter() - t0
        if sft_args.max_seconds > 0 and elapsed >= sft_args.max_seconds and step < sft_args.steps:
            print(f"sft: stopped at step {step}/{sft_args.steps} after {elapsed:.0f} s "
                  f"(sft.max_seconds={sft_args.max_seconds:g})", flush=True)
            break
    out = Path(out_dir)
    learner.save_checkpoint(out)
    result = SFTResult(str(out), len(losses), checks[-1][1] if checks else None, checks, losses,
                       round(time.perf_counter() - t0, 2), round(time.process_time() - cpu0, 2))
    record = {"result": dataclasses.asdict(result), "kv_policy": policy_record(specs),
              "learner_args": dataclasses.asdict(learner_args), "sft_args": dataclasses.asdict(sft_args)}
    (out / MARKER).write_text(json.dumps(record, indent=1) + "\n")
    return result


def cached_sft(cache_dir: str | Path, model_path: str | Path, train_examples: list[SFTExample],
               held_out_examples: list[SFTExample], kv_policy: str | Sequence[str], learner_args: LearnerArgs,
               sft_args: SFTArgs) -> SFTResult:
    """``run_sft`` into ``cache_dir/sft-<fingerprint>``, or the finished checkpoint already there or bundled with
    sliderl (``finished_sft``; no training)."""
    key = fingerprint(model_path, train_examples, held_out_examples, kv_policy, learner_args, sft_args)
    if (found := finished_sft(cache_dir, key)) is not None:
        return found
    path = Path(cache_dir).expanduser() / f"sft-{key}"
    staging = path.parent / f".{path.name}.training-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        run_sft(model_path, staging, train_examples, held_out_examples, kv_policy, learner_args, sft_args)
        publish(staging, path)
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # gone already unless training or publishing failed
    return read_result(path)


def finished_sft(cache_dir: str | Path, key: str) -> SFTResult | None:
    """The finished checkpoint ``sft-<key>`` of the local ``cache_dir``; else the one bundled with sliderl
    (``bundled``), copied into the cache first; else None."""
    path = Path(cache_dir).expanduser() / f"sft-{key}"
    if (path / MARKER).is_file():
        return read_result(path)
    if (bundle := bundled(key)) is None:
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.parent / f".{path.name}.bundled-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        shutil.copytree(bundle, staging)
        publish(staging, path)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return read_result(path)


def bundled(key: str) -> Path | None:
    """The finished checkpoint ``sft-<key>`` that ships with sliderl (``BUNDLED``: the default job's warm start, so
    ``sliderl train`` reaches RL in seconds), or None."""
    path = BUNDLED / f"sft-{key}"
    return path if (path / MARKER).is_file() else None


def read_result(path: str | Path) -> SFTResult:
    """The ``SFTResult`` of the finished checkpoint at ``path`` (from its marker), pointing at ``path``."""
    data = json.loads((Path(path) / MARKER).read_text())["result"]
    data["checks"] = [tuple(c) for c in data["checks"]]
    return SFTResult(**{**data, "path": str(path)})


def publish(staging: Path, path: Path) -> None:
    """Rename the finished ``staging`` folder to ``path``; a finished copy already there wins."""
    try:
        staging.rename(path)
    except OSError:
        if not (path / MARKER).is_file():
            shutil.rmtree(path, ignore_errors=True)  # an unfinished leftover without its marker
            staging.rename(path)
        else:
            shutil.rmtree(staging, ignore_errors=True)


def fingerprint(model_path: str | Path, train_examples: list[SFTExample], held_out_examples: list[SFTExample],
                kv_policy: str | Sequence[str], learner_args: LearnerArgs, sft_args: SFTArgs) -> str:
    """12 hex digits over everything that changes the trained weights (``log_every`` does not, nor the summary tool
    without a summary policy)."""
    sft = changed_settings(sft_args)
    sft.pop("log_every", None)
    if not any(KVPolicy.parse(spec).kind == "summary" for spec in policy_specs(kv_policy)):
        sft.pop("summary_tool", None)
    blob = json.dumps({
        "model": model_fingerprint(model_path),
        "train": [example_key(e) for e in train_examples],
        "held_out": [example_key(e) for e in held_out_examples],
        "kv_policy": policy_record(policy_specs(kv_policy)),
        "learner_args": changed_settings(learner_args),
        "sft_args": sft,
    }, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def changed_settings(settings) -> dict:
    """The fields of dataclass ``settings`` that differ from their defaults (a field without one always), as
    ``dataclasses.asdict`` writes them: a setting added later, at a default that keeps what was trained before,
    leaves every key (and the bundled warm start) as it was."""
    record = dataclasses.asdict(settings)
    changed = {}
    for field in dataclasses.fields(settings):
        if field.default is not dataclasses.MISSING:
            default = field.default
        elif field.default_factory is not dataclasses.MISSING:
            default = field.default_factory()
        else:
            changed[field.name] = record[field.name]
            continue
        if getattr(settings, field.name) != default:
            changed[field.name] = record[field.name]
    return changed


def example_key(example: SFTExample) -> tuple:
    """What of ``example`` shapes the weights: (prompt, completion), and the prompt ids when it carries them."""
    if example.prompt_token_ids is None:
        return example.prompt, example.completion
    return example.prompt, example.completion, list(example.prompt_token_ids)


def model_fingerprint(model_path: str | Path) -> str:
    """sha256 over a model directory's config, tokenizer and weight files (names and bytes)."""
    root = Path(model_path)
    digest = hashlib.sha256()
    files = sorted(p for p in root.iterdir() if p.name in MODEL_FILES or p.suffix in WEIGHT_SUFFIXES)
    if not any(p.name == "config.json" for p in files):
        raise FileNotFoundError(f"no config.json in {str(model_path)!r}; an SFT stage starts from a HF model directory")
    for file in files:
        digest.update(file.name.encode())
        if file.suffix == ".json":  # what transformers writes: the same settings under another version, same key
            record = json.loads(file.read_text())
            if isinstance(record, dict):
                record.pop("transformers_version", None)
            digest.update(json.dumps(record, sort_keys=True).encode())
            continue
        with file.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()
