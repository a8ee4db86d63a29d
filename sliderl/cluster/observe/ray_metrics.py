"""The Ray custom metrics the actors export, shown by the Ray dashboard and Prometheus.

Names as Prometheus shows them carry Ray's ``ray_`` prefix; every metric is tagged ``role``
(rollout | learner) and ``worker_id``: ``sliderl_rollout_tokens_per_s``,
``sliderl_visible_kv_tokens``, ``sliderl_reward``, ``sliderl_learner_step_seconds`` (histogram),
``sliderl_staleness_versions``, ``sliderl_weight_sync_seconds`` (histogram),
``sliderl_queue_depth`` and ``sliderl_learner_steps`` (counter). Create the metric classes inside
the actor that records them: Ray metrics belong to the process that made them.
"""

from __future__ import annotations

_TAG_KEYS = ("role", "worker_id")
_SECONDS_BUCKETS = [0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600]


def _gauge(name: str, description: str, tags: dict[str, str]):
    from ray.util.metrics import Gauge

    return Gauge(name, description, tag_keys=_TAG_KEYS).set_default_tags(tags)


def _histogram(name: str, description: str, tags: dict[str, str]):
    from ray.util.metrics import Histogram

    return Histogram(name, description, boundaries=_SECONDS_BUCKETS, tag_keys=_TAG_KEYS).set_default_tags(tags)


def _counter(name: str, description: str, tags: dict[str, str]):
    from ray.util.metrics import Counter

    return Counter(name, description, tag_keys=_TAG_KEYS).set_default_tags(tags)


class RolloutMetrics:
    """A rollout worker's Ray metrics; make it inside the worker actor."""

    def __init__(self, worker_id: int | str):
        tags = {"role": "rollout", "worker_id": str(worker_id)}
        self.tokens_per_s = _gauge("sliderl_rollout_tokens_per_s", "generated tokens per second", tags)
        self.visible_kv = _gauge("sliderl_visible_kv_tokens", "mean visible KV tokens per decode step", tags)
        self.reward = _gauge("sliderl_reward", "mean reward of the latest traces", tags)

    def record(self, tokens_per_s: float | None = None, visible_kv: float | None = None,
               reward: float | None = None) -> None:
        """Set the latest values; None leaves a metric as it was."""
        _set(self.tokens_per_s, tokens_per_s)
        _set(self.visible_kv, visible_kv)
        _set(self.reward, reward)


class LearnerMetrics:
    """The learner's Ray metrics; make it inside the learner actor."""

    def __init__(self, worker_id: int | str = "learner"):
        tags = {"role": "learner", "worker_id": str(worker_id)}
        self.step_seconds = _histogram("sliderl_learner_step_seconds", "wall seconds per learner step", tags)
        self.staleness = _gauge("sliderl_staleness_versions", "policy versions between sampling and training", tags)
        self.weight_sync_seconds = _histogram("sliderl_weight_sync_seconds", "wall seconds per weight sync", tags)
        self.queue_depth = _gauge("sliderl_queue_depth", "groups waiting in the trace queue", tags)
        self.reward = _gauge("sliderl_reward", "mean reward of the trained groups", tags)
        self.steps = _counter("sliderl_learner_steps", "learner steps done", tags)

    def record(self, step_seconds: float | None = None, staleness: float | None = None,
               weight_sync_seconds: float | None = None, queue_depth: float | None = None,
               reward: float | None = None) -> None:
        """Record one learner step (counted when ``step_seconds`` is given); None skips a value."""
        if step_seconds is not None:
            self.step_seconds.observe(float(step_seconds))
            self.steps.inc()
        if weight_sync_seconds is not None:
            self.weight_sync_seconds.observe(float(weight_sync_seconds))
        _set(self.staleness, staleness)
        _set(self.queue_depth, queue_depth)
        _set(self.reward, reward)


def _set(gauge, value: float | None) -> None:
    if value is not None:
        gauge.set(float(value))
