"""The learner actor: ``trainer.learner.Learner`` plus the sending end of weight sync.

A plain class; ``cluster.resources`` makes it a Ray actor with the learner's resources. It runs
one call at a time, so a checkpoint or a publish always sees the weights of a finished step.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from cluster.weight_sync import FlatLayout, WeightSender
from rollout.trace import Trace
from trainer.learner_args import LearnerArgs

if TYPE_CHECKING:
    from trainer.learner import StepMetrics
    from trainer.manifest import Manifest


class LearnerActor:
    """Trains on groups of traces; publishes and checkpoints its weights.

    checkpoint: a directory written by ``Learner.save_checkpoint`` to resume from (then
    ``model_path`` is ignored); else the learner starts from the HF directory ``model_path``.
    """

    def __init__(self, model_path: str, args: LearnerArgs, sync_backend: str, num_threads: int = 1,
                 checkpoint: str | None = None):
        import torch

        from trainer.learner import Learner

        torch.set_num_threads(max(1, num_threads))
        if checkpoint is not None:
            self.learner = Learner.from_checkpoint(checkpoint, args=args, verify=False)  # the driver checked it
        else:
            self.learner = Learner(model_path, args)
        self.sender = WeightSender(sync_backend, args.device)
        self._ray_metrics = _ray_metrics()

    def step(self, groups: list[list[Trace]]) -> StepMetrics:
        """One optimizer step on ``groups``; the learner's ``StepMetrics`` (version and seconds included)."""
        metrics = self.learner.step(groups)
        if self._ray_metrics is not None:
            self._ray_metrics.record(step_seconds=metrics.step_seconds)
        return metrics

    def args(self) -> LearnerArgs:
        """The settings the learner was built with."""
        return self.learner.args

    def version(self) -> int:
        return int(self.learner.version)

    def publish_weights(self, version: int) -> Any:
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

    def save_checkpoint(self, path: str) -> Manifest:
        """``Learner.save_checkpoint(path)``: HF layout plus optimizer, version and RNG; the files' manifest."""
        return self.learner.save_checkpoint(path)

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
        from cluster.ray_metrics import LearnerMetrics

        return LearnerMetrics()
    except Exception:  # metrics are best-effort: a missing metrics agent must not stop training
        return None
