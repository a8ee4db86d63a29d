"""What a run starts from, settled before any actor exists: the storage root (run_dir), resolved config,
data (fields checked), the initial model, the warm start's examples, the checkpoint to resume and, with
``reward.speedup``, the Baseline-SFT checkpoint.
Every mistake a user can make here is a ``ConfigError`` naming the bad value.

The storage root (``cluster.storage.root``) holds the run's config, checkpoints, driver state and traces.
A local root is also the driver's own folder. For a URI root the driver keeps its own files
(task data, metrics.jsonl, W&B's offline folder, plots, summary) in a temporary folder and copies
them to the root (``RunPlan.push_driver_files``, ``RunPlan.finish``); a resume starts by copying them
back, so a fresh driver with nothing on its disk continues the run from the root alone.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path, PurePath

from sliderl.cluster.actors.baseline import baseline_model_path
from sliderl.cluster.config.base import check_device, check_outlives_job, to_yaml
from sliderl.cluster.config.prompts import PromptFormat, prompt_format
from sliderl.cluster.config.train import TrainConfig
from sliderl.cluster.errors import ConfigError
from sliderl.cluster.observe.monitor import DRIVER_FILES, EVAL_DIR, WANDB_DIR
from sliderl.cluster.records import Problem
from sliderl.cluster.run.checkpoints import Checkpoints, DamagedCheckpoint, DriverState
from sliderl.cluster.run.lock import RunLock
from sliderl.cluster.run.resume import check_resumed_config, record_config
from sliderl.cluster.run.sft_job import keep_fitting_examples, stage_examples
from sliderl.cluster.storage.data import data_sources, keep_fitting, load_split
from sliderl.cluster.storage.root import Storage
from sliderl.trainer.sft import SFTExample


@dataclass
class RunPlan:
    """What a run starts from, checked before any actor exists."""

    storage: Storage  # the run's storage root (run_dir)
    local_dir: Path  # the driver's own files: the root itself when local, else a temporary folder
    model_path: str  # the configured model on the driver's disk, before any warm start
    train_problems: list[Problem]
    eval_problems: list[Problem]
    resume: tuple[PurePath, DriverState] | None
    warm_start: tuple[list[SFTExample], list[SFTExample]] | None = None  # the stage's (train, held-out) examples
    baseline_model: str | None = None  # reward.speedup's Baseline-SFT checkpoint (cluster.actors.baseline)
    lock: RunLock | None = None  # this driver's hold on run_dir, released by finish()

    @property
    def run_dir(self) -> Path | str:
        """The root as users name it: a Path when local, else its URI."""
        return self.storage.root if self.storage.local else self.storage.location

    def push_driver_files(self, final: bool = False) -> bool:
        """Copy the driver's own files to a remote root: metrics.jsonl, and when ``final`` also the summary,
        plots, W&B's folder and the evaluations' rows (nothing to do for a local root). False when a copy failed
        (with a warning)."""
        if self.storage.local:
            return True
        try:
            for name in DRIVER_FILES if final else DRIVER_FILES[:1]:
                if (self.local_dir / name).is_file():
                    self.storage.write_bytes(self.storage.path(name), (self.local_dir / name).read_bytes())
            for folder in (WANDB_DIR, EVAL_DIR) if final else ():
                if (self.local_dir / folder).is_dir():
                    self.storage.upload(self.local_dir / folder, self.storage.path(folder))
        except OSError as err:  # the checkpoints are what a resume needs; these files can wait for the next copy
            print(f"sliderl: warning: could not copy the driver's files from {self.local_dir} to "
                  f"{self.storage.location}: {err}", file=sys.stderr, flush=True)
            return False
        return True

    def finish(self) -> None:
        """The driver's last copy to a remote root (its temporary folder goes once everything is there), then
        the run_dir's lock goes."""
        try:
            if self.push_driver_files(final=True) and not self.storage.local:
                shutil.rmtree(self.local_dir, ignore_errors=True)
        finally:
            if self.lock is not None:
                self.lock.release()


def prepare(cfg: TrainConfig) -> RunPlan:
    """Storage root (locked for this driver), resolved config, data (fields checked), initial model and warm-start
    examples; no Ray yet. The config is recorded in run_dir once every check passed."""
    check_devices(cfg)
    check_wandb(cfg)
    check_compile_elementwise(cfg)
    check_outlives_job(cfg.run_dir, "run_dir")
    check_cluster_address(cfg)
    baseline = baseline_model_path(cfg) if cfg.reward.speedup is not None else None
    storage, lock = _lock_run(cfg)
    try:
        local_dir, resume, changes = _open_run(cfg, storage)
        train_source, eval_source = data_sources(cfg, local_dir)
        train_problems = load_split(cfg, train_source)
        wants_eval = cfg.eval.before or cfg.eval.after
        eval_problems = load_split(cfg, eval_source, cfg.eval.num_problems) if wants_eval else []
        # prompts are written (raw or chat template) and checked against the configured model's tokenizer and
        # length first: a dataset nothing of which fits is an error before the warm start (which keeps the
        # tokenizer and the config); the warm start's prompts are written the same way
        model_path = cfg.model.resolve()
        prompts = prompt_format_of(cfg, model_path)
        train_problems, eval_problems = engine_prompts(cfg, model_path, prompts, train_problems, eval_problems)
        warm_start = warm_start_examples(cfg, model_path, prompts) if cfg.warmstart.enabled else None
        _record_config(cfg, storage, resume, changes)
    except BaseException:
        lock.release()
        raise
    return RunPlan(storage, local_dir, model_path, train_problems, eval_problems, resume, warm_start, baseline, lock)


def _lock_run(cfg: TrainConfig) -> tuple[Storage, RunLock]:
    """The storage root, created, and this driver's lock on it (RunDirInUse while another driver runs there)."""
    try:
        storage = Storage(cfg.run_dir)
        storage.make_dir(storage.root)
        return storage, RunLock.acquire(storage)
    except OSError as err:  # pyarrow's errors (unreachable endpoint, no bucket, no credentials) are OSErrors
        raise _unwritable(cfg.run_dir, err) from None


def _open_run(cfg: TrainConfig, storage: Storage) -> tuple[Path, tuple[PurePath, DriverState] | None, list[str]]:
    """The run's folders checked writable, the checkpoint to resume (its config compared with this one: the
    allowed changes), and the driver's own folder (with a remote root's driver files when resuming); a root that
    cannot be reached or written is a ConfigError."""
    try:
        check_run_folders(storage)
        checkpoints = Checkpoints(storage, cfg.checkpoint.keep)
        resume = latest_checkpoint(checkpoints) if cfg.resume else None
        if cfg.resume and resume is None:
            raise ConfigError(f"resume=true but {storage.uri(checkpoints.dir)} holds no complete, intact checkpoint")
        if not cfg.resume and checkpoints.complete():
            raise ConfigError(f"run_dir {storage.location!r} already holds checkpoints of a run; pass resume=true "
                              "to continue it, or choose another run_dir")
        changes = check_resumed_config(storage, cfg.model_dump(mode="json")) if resume is not None else []
        if storage.local:
            return Path(storage.root), resume, changes
        local_dir = Path(tempfile.mkdtemp(prefix="sliderl-run-"))
        for name in DRIVER_FILES if resume is not None else ():  # a resumed Monitor reads them back
            if storage.is_file(storage.path(name)):
                (local_dir / name).write_bytes(storage.read_bytes(storage.path(name)))
        return local_dir, resume, changes
    except OSError as err:
        raise _unwritable(cfg.run_dir, err) from None


def check_run_folders(storage: Storage) -> None:
    """Each folder the run writes into (the root, checkpoints/, traces/) is a folder and takes a file (a probe,
    written and removed): a file in its place, a read-only or full disk or a bucket that refuses writes is a
    ConfigError here, not a traceback at the first checkpoint."""
    for folder in (storage.root, storage.path("checkpoints"), storage.path("traces")):
        if storage.is_file(folder):
            raise ConfigError(f"run_dir: {storage.uri(folder)} is a file where the run keeps a folder; move it away "
                              "or choose another run_dir")
        storage.make_dir(folder)
        probe = folder / f".sliderl-write-check-{os.getpid()}"
        storage.write_bytes(probe, b"")
        storage.delete(probe)


def _record_config(cfg: TrainConfig, storage: Storage, resume, changes: list[str]) -> None:
    """config.yaml and its history; a resume prints what it changes."""
    if changes:
        print(f"sliderl: resume changes {'; '.join(changes)}", flush=True)
    note = "started" if resume is None else f"resumed from {resume[0].name}"
    if changes:
        note += f", changing {', '.join(change.split(':')[0] for change in changes)}"
    try:
        record_config(storage, to_yaml(cfg), note)
    except OSError as err:
        raise _unwritable(cfg.run_dir, err) from None


def _unwritable(run_dir: str, err: OSError) -> ConfigError:
    where = f": {err.filename}" if getattr(err, "filename", None) else ""
    return ConfigError(f"run_dir {run_dir!r} cannot be written ({err.strerror or ' '.join(str(err).split())}{where}); "
                       "choose a writable folder, or check the storage URI, its bucket and credentials")


def latest_checkpoint(checkpoints: Checkpoints) -> tuple[PurePath, DriverState] | None:
    """``checkpoints.latest()`` (damaged ones skipped with a warning); one it cannot judge is a ConfigError."""
    try:
        return checkpoints.latest()
    except DamagedCheckpoint as err:
        raise ConfigError(f"resume=true: {err}") from None


def warm_start_examples(cfg: TrainConfig, model_path: str, prompts: PromptFormat):
    """The warm start's (train, held-out) examples, those longer than the model's context refused (or, with
    warmstart.data.skip_invalid, left out)."""
    from transformers import AutoConfig

    context = AutoConfig.from_pretrained(model_path, local_files_only=True).max_position_embeddings
    return keep_fitting_examples(stage_examples(cfg.warmstart, cfg.task, prompts), prompts.tokenizer, context,
                                 cfg.warmstart.data.skip_invalid, cfg.warmstart.data.source)


def prompt_format_of(cfg: TrainConfig, model_path: str) -> PromptFormat:
    """How ``cfg.data`` writes prompts (raw, or the chat template of ``model_path``'s tokenizer)."""
    from sliderl.core.loader import load_tokenizer

    return prompt_format(cfg.data, cfg.model, load_tokenizer(model_path))


def engine_prompts(cfg: TrainConfig, model_path: str, prompts: PromptFormat, train: list[Problem],
                   evaluation: list[Problem]):
    """Train and eval problems with their prompts written by ``prompts``, kept when the written prompt fits
    the engine's max_model_len (others left out, counted)."""
    from transformers import AutoConfig

    limit = cfg.engine.max_model_len or AutoConfig.from_pretrained(model_path, local_files_only=True).max_position_embeddings
    fitting = keep_fitting(prompts.apply(train), limit, "train")
    evaluation = keep_fitting(prompts.apply(evaluation), limit, "eval") if evaluation else evaluation
    check_pool(cfg, limit, [(fitting, cfg.sampling.max_tokens, "train"),
                            (evaluation, cfg.eval_sampling().max_tokens, "eval")])
    return fitting, evaluation


def check_pool(cfg: TrainConfig, max_model_len: int, uses: list[tuple[list[Problem], int, str]]) -> None:
    """A ConfigError when ``engine.num_blocks`` cannot hold one request of the longest prompt of each use (problems,
    max_tokens, what): the engine would refuse it inside a rollout worker. A pool sized from memory is not known yet."""
    from sliderl.rollout.modes import request_block_bound

    engine = cfg.engine
    for problems, max_tokens, what in uses:
        if engine.num_blocks is None or not problems:
            continue
        longest = max(len(p.prompt_token_ids) for p in problems)
        need = request_block_bound(engine, longest, max_tokens, max_model_len)
        if need > engine.num_blocks:
            raise ConfigError(f"engine.num_blocks={engine.num_blocks} cannot hold one {what} request: its longest "
                              f"prompt ({longest} tokens) with max_tokens={max_tokens} may hold {need} blocks of "
                              f"{engine.block_size} tokens under engine.kv={engine.kv} "
                              f"(max_model_len={max_model_len}); set engine.num_blocks >= {need}, or lower the "
                              "max_tokens or the window")


def check_cluster_address(cfg: TrainConfig) -> None:
    """The cluster to join (``ray.address`` or RAY_ADDRESS) answers on its port; a ResourceError (a ConfigError)
    naming it otherwise. A local run checks nothing."""
    from sliderl.cluster.actors.placement import check_reachable, cluster_address

    address = cluster_address(cfg)
    if address is not None:
        check_reachable(address)


def check_wandb(cfg: TrainConfig) -> None:
    """W&B asked for (online or offline) without the wandb package is a ConfigError before Ray starts, not an
    ImportError from the driver after the placement group."""
    if cfg.monitor.wandb.mode == "disabled":
        return
    try:
        import wandb  # noqa: F401
    except ImportError:
        raise ConfigError(f"monitor.wandb.mode={cfg.monitor.wandb.mode} needs the wandb package, which this Python "
                          "lacks: pip install wandb, or set monitor.wandb.mode=disabled") from None


def check_compile_elementwise(cfg: TrainConfig) -> None:
    """``learner.compile_elementwise`` on a CPU learner needs a C++ compiler (inductor builds CPU kernels with
    one): without it the learner actor would fail at its first step, after Ray, the warm start and the rollouts
    started. A ConfigError here instead."""
    from sliderl.core.model import COMPILE_BACKEND

    # auto is off on a CPU learner: only an explicit true needs the compiler
    explicit = cfg.learner.compile_elementwise is True
    if not explicit or cfg.learner.device.startswith("cuda") or COMPILE_BACKEND != "inductor":
        return
    if not any(shutil.which(c) for c in ("g++", "c++", "clang++")):
        raise ConfigError("learner.compile_elementwise=true with learner.device=cpu needs a C++ compiler (g++, c++ or "
                          "clang++ on PATH) for torch.compile's CPU kernels, and none was found: install one, or set "
                          "learner.compile_elementwise=false (it is meant for CUDA learners)")


def check_devices(cfg: TrainConfig) -> None:
    """A CUDA device asked of a local run whose torch has no CUDA is a ConfigError (before Ray starts).

    Joining a cluster, the driver's own torch says nothing about the workers' nodes: Ray's resource
    check covers them (``rollout.num_gpus``, ``learner.num_gpus``).
    """
    from sliderl.cluster.actors.placement import cluster_address

    if cluster_address(cfg) is not None:
        return
    for key, device in (("engine.device", cfg.engine.device), ("learner.device", cfg.learner.device),
                        ("warmstart.learner.device", cfg.warmstart.learner.device if cfg.warmstart.enabled else "cpu")):
        check_device(device, key)
    ranks = cfg.learner.num_ranks
    if ranks > 1 and cfg.learner.device.startswith("cuda"):
        import torch

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count < ranks:
            raise ConfigError(f"learner.num_ranks={ranks} puts each rank on a GPU of its own (NCCL), but this machine "
                              f"has {count} CUDA device(s); lower learner.num_ranks to at most {count} or set "
                              "learner.device=cpu (gloo)")
