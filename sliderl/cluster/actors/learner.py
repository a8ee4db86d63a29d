"""The learner actor: ``trainer.learner.Learner`` plus the sending end of weight sync.

A plain class; ``cluster.actors.learner_group`` makes N of them Ray actors, one per rank, with the
learner's resources. It runs one call at a time, so a checkpoint or a publish always sees the weights of
a finished step. Checkpoints go from here straight to the run's storage root (``cluster.storage.root``),
whichever node this actor runs on: into the folder when the root is local, else written to a temporary
folder on this node and uploaded; a resume from a remote checkpoint downloads it the same way.

A rank of a sharded learner (``group`` given) joins the ranks' process group before it builds its
``Learner``; the group calls step, publish, checkpoint on every rank alike (collectives inside). A rank
whose collective fails (a peer died, or did not arrive within ``learner.collective_timeout_s``) exits its
process, so the driver sees a lost learner and restarts the group from the latest checkpoint.
"""

from __future__ import annotations

import functools
import os
import sys
import tempfile
import traceback
from typing import TYPE_CHECKING

from sliderl.cluster.actors.weight_sync import FlatLayout, WeightPayload, WeightSender
from sliderl.cluster.storage.model_files import ModelFiles, local_folder
from sliderl.cluster.storage.root import Storage, is_uri
from sliderl.core.trace import Trace
from sliderl.trainer.learner_args import LearnerArgs
from sliderl.trainer.parallel import ProcessGroupSpec

if TYPE_CHECKING:
    from sliderl.trainer.manifest import Manifest
    from sliderl.trainer.metrics import StepMetrics


def collective(method):
    """A method with collectives inside: on a sharded learner's rank, any failure other than a bad input
    (ValueError) or a diverged step (FloatingPointError), which every rank raises alike, leaves the process
    group unusable, so the rank exits and the driver restarts the group."""
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except (ValueError, FloatingPointError):
            raise
        except Exception:
            if self.group is None:
                raise
            print(f"sliderl: learner rank {self.rank}: a collective failed in {method.__name__}; exiting so the "
                  f"driver restarts the learner group:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
            os._exit(1)
    return run


class LearnerActor:
    """Trains on groups of traces; publishes and checkpoints its weights.

    checkpoint: a folder written by ``Learner.save_checkpoint`` to resume from, a local path or a
    storage URI (then ``model`` is ignored); else the learner starts from ``model``, a ``ModelFiles``
    (opened on this actor's node) or a local HF folder. group: the process group of a sharded learner,
    which this actor joins as ``rank`` (None: one process, the plain model).
    """

    def __init__(self, model: ModelFiles | str, args: LearnerArgs, sync_backend: str, num_threads: int = 1,
                 checkpoint: str | None = None, group: ProcessGroupSpec | None = None, rank: int = 0):
        import torch

        from sliderl.trainer.learner import Learner
        from sliderl.trainer.parallel import FSDPParallel

        torch.set_num_threads(max(1, num_threads))
        self.group, self.rank = group, rank
        parallel = None if group is None else FSDPParallel.join(group, rank, torch.device(args.device))
        if checkpoint is None:
            self.learner = Learner(local_folder(model), args, parallel=parallel)
        elif not is_uri(checkpoint):  # the driver checked it
            self.learner = Learner.from_checkpoint(checkpoint, args=args, verify=False, parallel=parallel)
        else:  # the learner keeps what it needs of the folder in memory, so the copy can go
            storage = Storage(checkpoint)
            with tempfile.TemporaryDirectory(prefix="sliderl-resume-") as copy:
                storage.download(storage.root, copy)
                self.learner = Learner.from_checkpoint(copy, args=args, verify=False, parallel=parallel)
        self.sender = WeightSender(sync_backend, args.device)
        self._ray_metrics = _ray_metrics() if rank == 0 else None

    @collective
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

    @collective
    def publish_weights(self, version: int) -> WeightPayload | None:
        """The weight-sync payload of the current weights, which must be ``version``; the full weights are
        gathered one segment at a time (sharded: one FSDP2 unit; every rank takes part, rank 0 sends)."""
        if version != self.learner.version:
            raise ValueError(f"publish of version {version} asked, but the learner is at version {self.learner.version}")
        return self.sender.publish(version, self.learner.weight_segments(), sends=self.rank == 0)

    @collective
    def weight_layout(self) -> FlatLayout:
        """How the broadcast buffers are laid out, one segment after another (fixed for the model)."""
        return FlatLayout.of_segments(self.learner.weight_segments())

    def open_rendezvous(self) -> str:
        """``ip:port`` of a fresh rendezvous store on this node, for the broadcast group."""
        import ray

        return self.sender.open_rendezvous(ray.util.get_node_ip_address())

    def join_broadcast(self, address: str, world_size: int, name: str, backend: str, timeout_s: float) -> None:
        self.sender.join(address, world_size, name, backend, timeout_s)

    @collective
    def save_checkpoint(self, location: str) -> Manifest:
        """``Learner.save_checkpoint`` into ``location`` (a local folder or a storage URI): HF layout plus
        optimizer, version and RNG; returns the files' manifest once every file is in place (sharded: every
        rank uploads its own shards, and rank 0 returns after all of them have)."""
        if not is_uri(location):
            manifest = self.learner.save_checkpoint(location)
        else:
            storage = Storage(location)
            with tempfile.TemporaryDirectory(prefix="sliderl-checkpoint-") as staging:
                manifest = self.learner.save_checkpoint(staging)
                storage.upload(staging, storage.root)
        self.learner.parallel.barrier()
        return manifest

    def record(self, staleness: float | None = None, weight_sync_seconds: float | None = None,
               queue_depth: float | None = None, reward: float | None = None) -> None:
        """Driver-side numbers exported as the learner's Ray metrics."""
        if self._ray_metrics is not None:
            self._ray_metrics.record(staleness=staleness, weight_sync_seconds=weight_sync_seconds,
                                 queue_depth=queue_depth, reward=reward)

    @collective
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
