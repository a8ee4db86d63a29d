"""The learner actor: ``trainer.learner.Learner`` plus the sending end of weight sync.

A plain class; ``cluster.actors.placement`` makes it a Ray actor with the learner's resources. It runs
one call at a time, so a checkpoint or a publish always sees the weights of a finished step.
Checkpoints go from here straight to the run's storage root (``cluster.storage.root``), whichever node
this actor runs on: into the folder when the root is local, else written to a temporary folder on
this node and uploaded; a resume from a remote checkpoint downloads it the same way.
"""

from __future__ import annotations

import os
import tempfile
from typing import TYPE_CHECKING

from sliderl.cluster.actors.placement import actor_options, bundles, torch_threads
from sliderl.cluster.actors.weight_sync import FlatLayout, WeightPayload, WeightSender
from sliderl.cluster.config.train import TrainConfig
from sliderl.cluster.observe.dashboard import LEARNER
from sliderl.cluster.storage.model_files import ModelFiles, local_folder
from sliderl.cluster.storage.root import Storage, is_uri
from sliderl.core.trace import Trace
from sliderl.trainer.learner_args import LearnerArgs

if TYPE_CHECKING:
    from sliderl.trainer.manifest import Manifest
    from sliderl.trainer.metrics import StepMetrics


class LearnerActor:
    """Trains on groups of traces; publishes and checkpoints its weights.

    checkpoint: a folder written by ``Learner.save_checkpoint`` to resume from, a local path or a
    storage URI (then ``model`` is ignored); else the learner starts from ``model``, a ``ModelFiles``
    (opened on this actor's node) or a local HF folder.
    """

    def __init__(self, model: ModelFiles | str, args: LearnerArgs, sync_backend: str, num_threads: int = 1,
                 checkpoint: str | None = None):
        import torch

        from sliderl.trainer.learner import Learner

        torch.set_num_threads(max(1, num_threads))
        if checkpoint is None:
            self.learner = Learner(local_folder(model), args)
        elif not is_uri(checkpoint):
            self.learner = Learner.from_checkpoint(checkpoint, args=args, verify=False)  # the driver checked it
        else:  # the learner keeps what it needs of the folder in memory, so the copy can go
            storage = Storage(checkpoint)
            with tempfile.TemporaryDirectory(prefix="sliderl-resume-") as copy:
                storage.download(storage.root, copy)
                self.learner = Learner.from_checkpoint(copy, args=args, verify=False)
        self.sender = WeightSender(sync_backend, args.device)
        self._ray_metrics = _ray_metrics()

    def step(self, groups: list[list[Trace]]) -> StepMetrics:
        """One optimizer step on ``groups``; the learner's ``StepMetrics`` (version and seconds included)."""
        metrics = self.learner.step(groups)
        if self._ray_metrics is not None:
            self._ray_metrics.record(step_seconds=metrics.step_seconds)
        return metrics

    def release_memory(self) -> int:
        """Hand the CUDA memory the allocator caches back to the device, so rollout workers on this GPU can
        allocate their KV pools again after the step; the bytes still reserved (0 on CPU)."""
        import gc

        import torch

        if self.learner.device.type != "cuda":
            return 0
        gc.collect()
        torch.cuda.empty_cache()
        return int(torch.cuda.memory_reserved(self.learner.device))

    def args(self) -> LearnerArgs:
        """The settings the learner was built with."""
        return self.learner.args

    def version(self) -> int:
        return int(self.learner.version)

    def publish_weights(self, version: int) -> WeightPayload:
        """The weight-sync payload of the current weights, which must be ``version``."""
        if version != self.learner.version:
            raise ValueError(f"publish of version {version} asked, but the learner is at version {self.learner.version}")
        # object_store ships CPU tensors; the GPU backends flatten on the learner's GPU (no host round trip)
        device = "cpu" if self.sender.backend == "object_store" else self.sender.device
        return self.sender.publish(version, self.learner.state_dict(device))

    def weight_layout(self) -> FlatLayout:
        """How the broadcast buffers are laid out (fixed for the model)."""
        return FlatLayout.of(self.learner.state_dict())

    def open_rendezvous(self) -> str:
        """``ip:port`` of a fresh rendezvous store on this node, for the broadcast group."""
        import ray

        return self.sender.open_rendezvous(ray.util.get_node_ip_address())

    def join_broadcast(self, address: str, world_size: int, name: str, backend: str, timeout_s: float) -> None:
        self.sender.join(address, world_size, name, backend, timeout_s)

    def save_checkpoint(self, location: str) -> Manifest:
        """``Learner.save_checkpoint`` into ``location`` (a local folder or a storage URI): HF layout plus
        optimizer, version and RNG; returns the files' manifest once every file is in place."""
        if not is_uri(location):
            return self.learner.save_checkpoint(location)
        storage = Storage(location)
        with tempfile.TemporaryDirectory(prefix="sliderl-checkpoint-") as staging:
            manifest = self.learner.save_checkpoint(staging)
            storage.upload(staging, storage.root)
        return manifest

    def record(self, staleness: float | None = None, weight_sync_seconds: float | None = None,
               queue_depth: float | None = None, reward: float | None = None) -> None:
        """Driver-side numbers exported as the learner's Ray metrics."""
        if self._ray_metrics is not None:
            self._ray_metrics.record(staleness=staleness, weight_sync_seconds=weight_sync_seconds,
                                 queue_depth=queue_depth, reward=reward)

    def parameter(self, name: str) -> list[float]:
        """Current values of one weight, flattened (HF name); for checks."""
        return self.learner.state_dict()[name].detach().float().flatten().tolist()

    def pid(self) -> int:
        return os.getpid()


def _ray_metrics():
    try:
        from sliderl.cluster.observe.ray_metrics import LearnerMetrics

        return LearnerMetrics()
    except Exception:  # metrics are best-effort: a missing metrics agent must not stop training
        return None


def make_learner(cfg: TrainConfig, pg, model: ModelFiles | str, checkpoint: str | None = None):
    """The learner actor in bundle 0 (not restarted by Ray: the driver resumes it from a checkpoint)."""
    import ray


    options = actor_options(cfg, LEARNER, bundles(cfg)[0], pg, 0)
    return ray.remote(LearnerActor).options(max_restarts=0, **options).remote(
        model, cfg.learner_args(), cfg.weight_sync.backend, torch_threads(cfg.learner.num_cpus), checkpoint)
