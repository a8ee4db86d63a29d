"""The learner as the driver sees it: ``learner.num_ranks`` learner actors, one per placement-group bundle,
driven as one.

``LearnerGroup`` creates rank r in learner bundle r (``cluster.actors.placement``: with ``PACK`` the ranks
share a node where they fit and spread over nodes where they do not; ``learner.rank_resources`` pins a
rank to a node). A sharded learner's ranks (more than one, or FSDP2 at one: ``learner.fsdp``,
``learner.offload``) form one ``torch.distributed`` process group: the driver serves its rendezvous store,
so every rank joins while it is built (NCCL on GPU, gloo on CPU; ``learner.collective_timeout_s`` bounds
every collective).

Calls look like an actor handle's: ``group.step.remote(groups)`` returns an ObjectRef. Methods with
collectives inside (``ALL_RANKS``) go to every rank with the same arguments and return rank 0's ref;
the others (version, rendezvous of the weight-sync group, metrics) go to rank 0 only. A rank that dies
or hangs makes rank 0's collective fail, and rank 0 exits (``cluster.actors.learner.collective``): the
driver sees a lost learner and restarts the whole group from the latest checkpoint.
"""

from __future__ import annotations

from typing import Any

from sliderl.cluster.actors.learner import LearnerActor
from sliderl.cluster.actors.placement import actor_options, learner_bundles, torch_threads
from sliderl.cluster.config.train import TrainConfig
from sliderl.cluster.observe.dashboard import LEARNER
from sliderl.cluster.storage.model_files import ModelFiles
from sliderl.trainer.parallel import ProcessGroupSpec, open_rendezvous, process_group_backend

ALL_RANKS = frozenset({"step", "publish_weights", "weight_layout", "save_checkpoint", "parameter",
                       "release_memory"})


class LearnerGroup:
    """The learner's ranks, driven as one actor (see the module docstring)."""

    def __init__(self, cfg: TrainConfig, pg, model: ModelFiles | str, checkpoint: str | None = None):
        import ray

        section, spec = cfg.learner, None
        if section.sharded:
            self._store, address = open_rendezvous(ray.util.get_node_ip_address())  # lives as long as the group
            spec = ProcessGroupSpec(address, section.num_ranks, process_group_backend(section.device),
                                    section.collective_timeout_s, section.shard_ranks)
        bundles = learner_bundles(cfg)
        self.actors = [
            ray.remote(LearnerActor).options(max_restarts=0, **actor_options(cfg, rank_role(rank), bundles[rank], pg,
                                                                              rank)).remote(
                model, cfg.learner_args(), cfg.weight_sync.backend, torch_threads(section.num_cpus), checkpoint,
                spec, rank)
            for rank in range(section.num_ranks)]

    def __getattr__(self, method: str) -> _GroupMethod:
        if method.startswith("_"):
            raise AttributeError(method)
        return _GroupMethod(self.actors if method in ALL_RANKS else self.actors[:1], method)

    def pids(self) -> list[int]:
        """Every rank's process id, in rank order."""
        import ray

        return ray.get([actor.pid.remote() for actor in self.actors])

    def kill(self) -> None:
        """Stop every rank (those already gone are skipped)."""
        import ray

        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # already gone
                pass


class _GroupMethod:
    def __init__(self, actors: list, name: str):
        self.actors, self.name = actors, name

    def remote(self, *args: Any, **kwargs: Any):
        """Call the method on each of ``actors`` with the same arguments; rank 0's ObjectRef."""
        import ray

        if len(self.actors) > 1:  # one copy of large arguments (a step's groups) for every rank
            args = tuple(ray.put(a) if isinstance(a, list) else a for a in args)
        refs = [getattr(actor, self.name).remote(*args, **kwargs) for actor in self.actors]
        return refs[0]


def rank_role(rank: int) -> str:
    """The actor's role name: ``learner`` for rank 0 (the name a run's dashboard and tools look for)."""
    return LEARNER if rank == 0 else f"{LEARNER}-{rank}"


def make_learner(cfg: TrainConfig, pg, model: ModelFiles | str, checkpoint: str | None = None) -> LearnerGroup:
    """The learner's ranks in the first ``learner.num_ranks`` bundles (not restarted by Ray: the driver
    resumes the group from a checkpoint)."""
    return LearnerGroup(cfg, pg, model, checkpoint)
