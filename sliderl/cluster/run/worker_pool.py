"""The rollout workers as the driver sees them: handles, identities and health.

A worker's identity is its *incarnation* (a fresh id every time its process starts). The driver
asks every worker for its ``WorkerStatus`` every ``train.health_check_s``; a new incarnation means
Ray restarted the process (it lost its prompts and its weights), and two failed checks in a row
with ``ActorDiedError`` mean the worker is gone for good (its restarts are used up). A call sent
to a worker that is restarting simply waits, so a slow answer is never taken for a death.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field

from sliderl.cluster.actors.rollout_worker import make_worker
from sliderl.cluster.config.train import TrainConfig
from sliderl.cluster.errors import RunError, actor_death
from sliderl.cluster.records import PromptGroup
from sliderl.cluster.storage.model_files import ModelFiles


@dataclass
class Health:
    """What one health check found."""

    restarted: list[int] = field(default_factory=list)  # workers whose process was replaced
    died: list[int] = field(default_factory=list)  # workers gone for good


class WorkerPool:
    """Creates the rollout workers and tracks which of them are alive and who they are."""

    def __init__(self, cfg: TrainConfig, pg, model: ModelFiles | str, version: int, trace_queue):
        self.cfg = cfg
        self.handles = {wid: make_worker(cfg, pg, wid, model, version, trace_queue)
                        for wid in range(cfg.rollout.num_workers)}
        self.incarnations: dict[int, str] = {}
        self.pids: dict[int, int] = {}
        self.dead: set[int] = set()
        self._failures: dict[int, int] = {}
        self._pending: dict[int, object] = {}  # worker id -> status ref of the check in flight
        self._last_check = 0.0

    def start(self, timeout_s: float) -> None:
        """Wait until every worker has built its engine; RunError naming the one that failed."""
        import ray

        for wid, handle in self.handles.items():
            try:
                status = ray.get(handle.status.remote(), timeout=timeout_s)
            except Exception as err:  # an engine that cannot start (bad model, no memory, ...)
                raise RunError(f"rollout worker {wid} did not start: {' '.join(str(err).split())[:2000]}") from None
            self._saw(status)

    def live(self) -> dict[int, object]:
        return {wid: h for wid, h in self.handles.items() if wid not in self.dead}

    def submit(self, worker_id: int, groups: list[PromptGroup]) -> None:
        """Hand groups to a worker (fire and forget: a failure shows up in the next health check)."""
        if groups:
            self.handles[worker_id].submit.remote(groups)

    def release_memory(self) -> float:
        """Every live worker frees its KV pool (``RolloutWorker.release_memory``); wall seconds until all did."""
        return self._on_all("release_memory")

    def restore_memory(self) -> float:
        """Every live worker allocates its KV pool again; wall seconds until all did."""
        return self._on_all("restore_memory")

    def _on_all(self, method: str) -> float:
        """Call ``method`` on every live worker and wait for all; a worker that died meanwhile is left to the
        health check, one whose call failed stops the run."""
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        start = time.perf_counter()
        refs = {wid: getattr(handle, method).remote() for wid, handle in self.live().items()}
        for wid, ref in refs.items():
            try:
                ray.get(ref)
            except RayTaskError as err:
                raise RunError(f"rollout worker {wid}: {method} failed: {' '.join(str(err).split())[:2000]}") from None
            except RayActorError:
                continue
        return time.perf_counter() - start

    def check(self, force: bool = False) -> Health:
        """At most every health_check_s (or now when ``force``): collect answers, send new checks."""
        import ray

        health = Health()
        if not force and time.monotonic() - self._last_check < self.cfg.train.health_check_s:
            return health
        self._last_check = time.monotonic()
        if self._pending:
            ready, _ = ray.wait(list(self._pending.values()), num_returns=len(self._pending), timeout=0)
            for wid, ref in list(self._pending.items()):
                if ref in ready:
                    del self._pending[wid]
                    self._read(wid, ref, health)
        for wid, handle in self.live().items():
            if wid not in self._pending:
                self._pending[wid] = handle.status.remote()
        return health

    def _read(self, wid: int, ref, health: Health) -> None:
        import ray
        from ray.exceptions import ActorDiedError, RayActorError

        try:
            status = ray.get(ref)
        except ActorDiedError as err:
            self._failures[wid] = self._failures.get(wid, 0) + 1
            if self._failures[wid] >= 2 or err.actor_init_failed:
                self.dead.add(wid)
                health.died.append(wid)
                print(f"sliderl: rollout worker {wid} is gone for good: {actor_death(err)}",
                      file=sys.stderr)
            return
        except RayActorError:  # unavailable for the moment (e.g. restarting): ask again later
            return
        self._failures[wid] = 0
        if status.error:
            raise RunError(f"rollout worker {wid} failed: {status.error}")
        if self.incarnations.get(wid) not in (None, status.incarnation):
            health.restarted.append(wid)
        self._saw(status)

    def _saw(self, status) -> None:
        self.incarnations[status.worker_id] = status.incarnation
        self.pids[status.worker_id] = status.pid

    def stop(self) -> None:
        """Kill every worker (no restart)."""
        import ray

        for handle in self.handles.values():
            try:
                ray.kill(handle, no_restart=True)
            except Exception:  # already dead: nothing to stop
                pass
