"""The rollout worker's weight versions, on the plain class (no Ray): a sync moves the worker to the new version,
and a group keeps the version it started with when weights change while it generates."""

from __future__ import annotations

import queue

from safetensors.torch import load_file

from sliderl.cluster.actors.rollout_worker import RolloutWorker
from sliderl.cluster.actors.weight_sync import StateDictPayload
from sliderl.cluster.records import Problem, PromptGroup
from sliderl.rewards import RewardSpec
from sliderl.rollout import EngineArgs, SamplingParams


def test_a_sync_moves_the_worker_to_the_new_version_and_a_group_keeps_its_start_version(tiny_model_factory):
    # Catches (issue 37), two mutations the whole suite let through:
    # - a worker whose weight version is never updated after a sync (the sync test then hung for minutes: every
    #   group looked stale): status().version stays 0 and group B is stamped 0;
    # - a group stamped with the version at its finish instead of its start: group A, started at version 0 and
    #   finished after the update to 1 (its traces record the token index where the new weights took over),
    #   would say 1.
    # Order made certain without timing: evaluate() returns only after the engine admitted everything submitted
    # before it, so A is in flight (64 tokens, no early stop) when the update lands; B is submitted after it.
    model = tiny_model_factory("qwen3")
    out: queue.Queue = queue.Queue()
    worker = RolloutWorker(0, str(model), 0, EngineArgs(num_blocks=64), SamplingParams(max_tokens=64, ignore_eos=True),
                           RewardSpec(), "arith", out)
    try:
        worker.submit([PromptGroup("g00000000", Problem("p0", "1 + 1 =", "2"), 2, 7)])
        worker.evaluate(["2 + 2 ="], SamplingParams(max_tokens=1))  # A is admitted by now
        worker.update_weights(1, StateDictPayload(load_file(str(model / "model.safetensors"))))
        assert worker.status().version == 1
        worker.submit([PromptGroup("g00000001", Problem("p1", "3 + 3 =", "6"), 2, 9)])
        groups = {g.group_id: g for g in (out.get(timeout=120), out.get(timeout=120))}
    finally:
        worker.stop()
    started_before, started_after = groups["g00000000"], groups["g00000001"]
    assert all(0 < t.weight_update_token_index < 64 for t in started_before.traces)  # the update landed mid-trace
    assert started_before.policy_version == 0 and {t.policy_version for t in started_before.traces} == {0}
    assert started_after.policy_version == 1 and {t.policy_version for t in started_after.traces} == {1}
    assert all(t.weight_update_token_index == -1 for t in started_after.traces)
