"""Learner and engines on one GPU: ``LLM.sleep``/``wake``, a rollout worker's ``release_memory``, and
``rollout.release_between_steps`` through the config and the rollout backend seam."""

from __future__ import annotations

import queue as std_queue
import weakref

import pytest

from sliderl.cluster.config.base import load_config
from sliderl.cluster.config.train import TrainConfig
from sliderl.cluster.errors import ConfigError
from sliderl.rollout import LLM, EngineArgs, SamplingParams

PROMPTS = [[3, 1, 4, 1, 5], [9, 2, 6], [5, 3, 5, 8, 9, 7]]


def _params(seed: int) -> SamplingParams:
    return SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True, seed=seed)


def test_sleep_frees_the_pool_and_wake_generates_what_a_never_sleeping_engine_does(tiny_model_factory):
    # catches: sleep() keeping a reference to the KV pool (so nothing is freed), wake() allocating a pool
    # of another size or not at all, and state that does not survive a sleep (the scheduler's free list,
    # the block manager's counts): the engine that slept must generate exactly what one that never slept
    # does, request for request (same seeds, sampled at temperature 1, so every logit matters).
    path = tiny_model_factory(arch="qwen3")
    args = dict(kv="prefix_sliding:6", block_size=4, num_blocks=40)
    reference = LLM(path, **args)
    expected = [o.token_ids for o in reference.generate(PROMPTS + PROMPTS, [_params(s) for s in range(6)])]

    llm = LLM(path, **args)
    first = [o.token_ids for o in llm.generate(PROMPTS, [_params(s) for s in range(3)])]
    held = weakref.ref(llm.runner.cache.k[0])
    blocks = llm.runner.cache.num_blocks
    llm.sleep()
    assert held() is None and llm.runner.cache is None and llm.asleep
    llm.wake()
    assert llm.runner.cache.num_blocks == blocks and llm.scheduler.blocks.num_free == 40
    second = [o.token_ids for o in llm.generate(PROMPTS, [_params(s) for s in range(3, 6)])]
    assert first + second == expected


def test_a_sleeping_engine_queues_but_refuses_to_step_and_sleep_needs_no_running_request(tiny_model_factory):
    # catches: step() running over a freed pool (an AttributeError on None, or worse on CUDA) instead of a
    # clear error, and sleep() freeing the KV of requests that are still running
    llm = LLM(tiny_model_factory(arch="qwen3"), kv="full", block_size=4, num_blocks=32)
    seq = llm.add_request([1, 2, 3], _params(0))
    llm.step()
    with pytest.raises(RuntimeError, match="running requests still hold KV"):
        llm.sleep()
    while llm.has_unfinished():
        llm.step()
    llm.sleep()
    llm.sleep()  # twice is fine
    waiting = llm.add_request([4, 5], _params(1))  # queued, holds no KV
    with pytest.raises(RuntimeError, match=r"asleep .* call wake\(\)"):
        llm.step()
    llm.wake()
    while llm.has_unfinished():
        llm.step()
    assert len(llm.output(seq).token_ids) == len(llm.output(waiting).token_ids) == 12


def _worker(model, out):
    from sliderl.cluster.actors.rollout_worker import RolloutWorker
    from sliderl.rewards import RewardSpec

    return RolloutWorker(0, str(model), 0, EngineArgs(kv="prefix_sliding:6", block_size=4, num_blocks=64),
                         SamplingParams(max_tokens=10, temperature=1.0, ignore_eos=True), RewardSpec(), "arith", out)


def _group(n: int):
    from sliderl.cluster.records import Problem, PromptGroup

    return PromptGroup(f"g{n:08d}", Problem(f"p{n}", f"{n} + {n} =", str(2 * n)), 2, 100 + n)


def _next(out, worker):
    """The worker's next group; fails at once with the worker's error instead of waiting out the timeout."""
    for _ in range(120):
        try:
            return out.get(timeout=1)
        except std_queue.Empty:
            assert worker.status().error is None, worker.status().error
    raise AssertionError("no group in 120 s")


def test_a_worker_releases_its_pool_when_idle_and_wakes_for_new_work(tiny_model_factory):
    # catches: release running while the worker's requests are unfinished (sleep raises and the engine
    # thread dies, or their KV is freed under them), the engine thread stepping a sleeping engine instead
    # of waking it when new groups arrive (the worker fails or the group never comes), and release or
    # restore returning before the engine thread did it. The released worker's second group must carry
    # the tokens a worker that never released samples for it.
    model = tiny_model_factory(arch="qwen3")
    plain_out, out = std_queue.Queue(), std_queue.Queue()
    plain, worker = _worker(model, plain_out), _worker(model, out)
    try:
        plain.submit([_group(1)])
        plain.submit([_group(2)])
        expected = [_next(plain_out, plain), _next(plain_out, plain)]
        worker.submit([_group(1)])
        assert worker.release_memory() >= 0  # waits for group 1 to finish, then frees the pool
        assert worker.llm.asleep and worker.llm.runner.cache is None
        got = [_next(out, worker)]
        worker.submit([_group(2)])  # the engine thread wakes the engine for it
        got.append(_next(out, worker))
        assert not worker.llm.asleep and worker.status().error is None
        worker.release_memory()
        worker.restore_memory()
        assert not worker.llm.asleep and worker.llm.runner.cache is not None
    finally:
        plain.stop()
        worker.stop()
    tokens = lambda groups: [[t.completion_token_ids for t in g.traces] for g in groups]  # noqa: E731
    assert tokens(got) == tokens(expected)


def test_release_between_steps_needs_sync_mode_and_the_backend_must_be_registered():
    # catches: release_between_steps accepted in async mode (where workers generate during the learner step,
    # so there is never an idle moment to free the pool and the step would wait forever), and an unknown
    # rollout backend reaching the worker instead of failing at config load
    with pytest.raises(ConfigError, match="only train.mode=sync leaves idle; got train.mode=async"):
        load_config(TrainConfig, None, ["rollout.release_between_steps=true", "train.mode=async"])
    assert load_config(TrainConfig, None, ["rollout.release_between_steps=true", "train.mode=sync"]).rollout.release_between_steps
    with pytest.raises(ConfigError, match="unknown rollout backend 'vllm'; valid: paged"):
        load_config(TrainConfig, None, ["rollout.backend=vllm"])


@pytest.mark.gpu
def test_sleep_hands_the_pool_and_graphs_back_to_the_gpu_and_wake_gives_the_same_tokens(tiny_model_factory):
    # catches, on CUDA: sleep() leaving the pool or the captured graphs' memory allocated (the learner
    # beside it would not get it), and a wake() whose re-captured graphs point at the old pool (tokens
    # after wake would differ from a never-sleeping engine's, or the replay would read freed memory)
    import torch

    path = tiny_model_factory(arch="qwen3")
    args = dict(kv="prefix_sliding:64", device="cuda", dtype="bfloat16", block_size=16, kv_cache_gb=2.0)
    reference = LLM(path, **args)
    expected = [o.token_ids for o in reference.generate(PROMPTS + PROMPTS, [_params(s) for s in range(6)])]
    reference.close()
    llm = LLM(path, **args)
    first = [o.token_ids for o in llm.generate(PROMPTS, [_params(s) for s in range(3)])]
    awake = torch.cuda.memory_allocated()
    llm.sleep()
    asleep = torch.cuda.memory_allocated()
    assert awake - asleep >= 2 * 2**30 * 0.99, (awake, asleep)  # the whole 2 GiB pool went back
    llm.wake()
    second = [o.token_ids for o in llm.generate(PROMPTS, [_params(s) for s in range(3, 6)])]
    assert first + second == expected
    assert abs(torch.cuda.memory_allocated() - awake) < 64 * 2**20
