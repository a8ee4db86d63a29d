"""The warm start of ``sliderl train``: its SFT stage on a Ray actor of its own, cached by fingerprint.

The driver builds the stage's examples before Ray starts (``cluster.run.sft_job.stage_examples``). With a local
cache_dir it first looks for the finished checkpoint itself (in its node's cache, or bundled with sliderl:
``trainer.sft.finished_sft``) and uses it without an actor; otherwise ``warm_start`` hands the examples and the
initial model (``ModelFiles``) to a ``WarmStartActor`` placed by ``warmstart.num_cpus/num_gpus/resources``.
The actor trains with the one trainer (``trainer.sft``) or finds the checkpoint in the cache, and returns where
it is, with its files when the run's actors on other nodes need them.

The cache (``warmstart.cache_dir``) holds ``sft-<fingerprint>/`` per set of inputs (the model's
files, the examples, the visibility, the learner and SFT settings: ``trainer.sft.fingerprint``); a
folder with its marker ``sft.json`` is a finished checkpoint, used without training. A local
cache_dir lives on the actor's node (``trainer.sft.cached_sft``). A storage URI is shared by every
node: the stage trains into a local folder and uploads it, the marker last; an actor that finds the
marker there downloads the folder into ``$TMPDIR/sliderl-warmstart/``, its node's copy from then on.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

from sliderl.cluster.actors.placement import actor_options, torch_threads, warm_start_request
from sliderl.cluster.config.train import TrainConfig
from sliderl.cluster.observe.dashboard import WARM_START
from sliderl.cluster.storage.model_files import ModelFiles, folder_digest, local_folder, read_folder
from sliderl.cluster.storage.root import Storage, is_uri
from sliderl.trainer.learner_args import LearnerArgs
from sliderl.trainer.sft import (
    MARKER,
    SFTArgs,
    SFTExample,
    SFTResult,
    bundled,
    cached_sft,
    finished_sft,
    fingerprint,
    publish,
    read_result,
    run_sft,
)

COPIES = "sliderl-warmstart"


@dataclass
class WarmStarted:
    """The actor's answer: how the stage went, and where its checkpoint is (on which node, and where it
    is stored)."""

    result: SFTResult
    node_id: str
    stored: str  # the cache folder: a path on node ``node_id``, or a URI
    digest: str = ""  # of the checkpoint's files, when they were returned too


class WarmStartActor:
    """Runs one SFT stage (or finds it cached) where Ray placed it."""

    def __init__(self, num_threads: int = 1):
        import torch

        torch.set_num_threads(max(1, num_threads))

    def run(self, model: ModelFiles | str, cache_dir: str, train: list[SFTExample], held_out: list[SFTExample],
            kv_policy: str, learner_args: LearnerArgs, sft_args: SFTArgs,
            ship: bool) -> tuple[WarmStarted, dict[str, bytes] | None]:
        """The stage from ``model`` under ``kv_policy``, and with ``ship`` the checkpoint's files (a second
        return value: its object belongs to the caller and outlives this actor)."""
        import ray

        result, stored = cached_warm_start(cache_dir, local_folder(model), train, held_out, kv_policy, learner_args,
                                           sft_args)
        files = read_folder(result.path) if ship else None
        node = ray.get_runtime_context().get_node_id()
        return WarmStarted(result, node, stored, folder_digest(files) if files else ""), files


def cached_warm_start(cache_dir: str, model_path: str, train: list[SFTExample], held_out: list[SFTExample],
                      kv_policy: str, learner_args: LearnerArgs, sft_args: SFTArgs) -> tuple[SFTResult, str]:
    """``cached_sft`` in a local ``cache_dir`` or a storage URI; the result (its ``path`` a folder on this
    node) and where the checkpoint is stored."""
    if not is_uri(cache_dir):
        result = cached_sft(cache_dir, model_path, train, held_out, kv_policy, learner_args, sft_args)
        return result, result.path
    storage = Storage(cache_dir)
    key = fingerprint(model_path, train, held_out, kv_policy, learner_args, sft_args)
    name = f"sft-{key}"
    stored, copy = storage.path(name), Path(tempfile.gettempdir()) / COPIES / name
    if not (copy / MARKER).is_file():
        copy.parent.mkdir(parents=True, exist_ok=True)
        staging = copy.parent / f".{name}.{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        try:
            if storage.is_file(stored / MARKER):
                storage.download(stored, staging)
            else:
                if (bundle := bundled(key)) is not None:
                    shutil.copytree(bundle, staging)
                else:
                    run_sft(model_path, staging, train, held_out, kv_policy, learner_args, sft_args)
                storage.upload(staging, stored, last=MARKER)
            publish(staging, copy)
        finally:
            shutil.rmtree(staging, ignore_errors=True)  # gone already unless something failed
    return read_result(copy), storage.uri(stored)


def warm_start(cfg: TrainConfig, model: ModelFiles, examples: tuple[list[SFTExample], list[SFTExample]],
               multi_node: bool) -> ModelFiles:
    """The warm-started model of ``cfg`` from ``model``, trained (or found cached) on the stage's actor."""
    import ray
    from ray.exceptions import RayActorError, RayTaskError

    from sliderl.cluster.errors import RunError

    stage, sft = cfg.warmstart, stage_sft_args(cfg)
    if not is_uri(stage.cache_dir):  # finished already (in this node's cache, or bundled): no actor, no training
        key = stage_key(cfg, model.path, examples)
        if (found := finished_sft(stage.cache_dir, key)) is not None:
            origin = "bundled with sliderl" if bundled(key) is not None else "found in the cache"
            print(f"sliderl: warm start {found.line()} ({origin}, not trained now) -> {found.path}", flush=True)
            return ModelFiles.ship(found.path, multi_node)
    print(f"sliderl: warm start on its actor (at most {stage.sft.steps} SFT steps under {cfg.engine.kv}, cached in "
          f"{stage.cache_dir})", flush=True)
    actor = make_warm_start(cfg)
    try:
        done_ref, files = actor.run.options(num_returns=2).remote(model, stage.cache_dir, *examples, cfg.engine.kv,
                                                                  stage.learner, sft, multi_node)
        done: WarmStarted = ray.get(done_ref)
    except (RayActorError, RayTaskError) as err:
        raise RunError(f"the warm start failed: {' '.join(str(err).split())[:2000]}") from None
    finally:
        ray.kill(actor, no_restart=True)
    print(f"sliderl: warm start {done.result.line()} -> {done.stored}", flush=True)
    return ModelFiles(done.result.path, done.node_id, done.digest, files if done.digest else None)


def stage_sft_args(cfg: TrainConfig) -> SFTArgs:
    """The stage's ``SFTArgs``: ``warmstart.sft`` with the summary tool calls the engine reads."""
    return replace(cfg.warmstart.sft, summary_tool=cfg.engine.summary_tool)


def stage_key(cfg: TrainConfig, model_path: str, examples: tuple[list[SFTExample], list[SFTExample]]) -> str:
    """The fingerprint naming ``cfg``'s warm start (``sft-<key>`` in a cache or among the bundled ones)."""
    return fingerprint(model_path, *examples, cfg.engine.kv, cfg.warmstart.learner, stage_sft_args(cfg))


def make_warm_start(cfg: TrainConfig):
    """The warm start's actor, placed by ``warmstart.num_cpus/num_gpus/resources`` (before the placement
    group exists, so it may use what the run's actors will hold later)."""
    import ray


    options = actor_options(cfg, WARM_START, warm_start_request(cfg))
    return ray.remote(WarmStartActor).options(max_restarts=0, **options).remote(torch_threads(cfg.warmstart.num_cpus))
