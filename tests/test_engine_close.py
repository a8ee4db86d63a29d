"""``LLM.close()`` and ``with LLM(...) as llm``: the engine lets go of its pool, weights and queued step."""

from __future__ import annotations

import weakref

import pytest

from sliderl.rollout import LLM, SamplingParams

GREEDY = dict(temperature=0.0, ignore_eos=True)


def test_close_drops_pool_weights_and_queued_step_without_gc(tiny_model_factory):
    # catches: close() leaving a reference to the KV cache, the weights or the queued step's logits
    # (in the engine, the runner, the run-ahead state or the postprocessor), or freeing that waits
    # for a garbage collection (a reference cycle) or __del__
    path = tiny_model_factory(arch="qwen3")
    llm = LLM(path, kv="prefix_sliding:8", block_size=4, num_blocks=64, overlap=True)
    seqs = [llm.add_request(p, SamplingParams(max_tokens=30, **GREEDY)) for p in ([1, 2, 3], [4, 5])]
    for _ in range(4):
        llm.step()
    assert llm.run_ahead.queued is not None  # closed mid-run, a decode step queued ahead
    held = [weakref.ref(t) for t in (llm.runner.cache.k[0], llm.runner.cache.death, next(llm.model.parameters()),
                                     llm.run_ahead.queued.logits)]
    held += [weakref.ref(llm.runner), weakref.ref(llm.model)]
    llm.close()
    assert [ref() is None for ref in held] == [True] * len(held)
    assert not llm.scheduler.has_unfinished() and seqs[0].num_output < 30


def test_closed_engine_refuses_use_and_closes_once(tiny_model_factory):
    # catches: a closed engine failing with an AttributeError on None (or running on) instead of
    # saying it was closed, and a second close() that raises
    llm = LLM(tiny_model_factory(arch="qwen3"), kv="full", block_size=4, num_blocks=32)
    out = llm.generate([[1, 2]], SamplingParams(max_tokens=4, **GREEDY))[0]
    llm.close()
    llm.close()
    sp = SamplingParams(max_tokens=4)
    for use in (lambda: llm.generate([[1, 2]], sp), lambda: llm.add_request([1, 2], sp), llm.step,
                lambda: llm.load_weights({}), lambda: llm.output(out)):
        with pytest.raises(RuntimeError, match=r"this LLM was closed .* build a new LLM"):
            use()


def test_second_engine_after_closing_the_first_gives_the_same_outputs(tiny_model_factory):
    # catches: __exit__ not closing; a runner that keeps its pool or weights while something still
    # holds it (here the test; on CUDA its captured graphs do); and state shared between engines of
    # one process that closing breaks (the second engine must generate exactly what the first did)
    path = tiny_model_factory(arch="llama")
    prompts, sp = [[3, 1, 4, 1, 5], [9, 2, 6]], SamplingParams(max_tokens=20, **GREEDY)
    outs = []
    for _ in range(2):
        with LLM(path, kv="sliding_window:6", block_size=4, num_blocks=32) as llm:
            outs.append([o.token_ids for o in llm.generate(prompts, sp)])
            runner = llm.runner
            held = [weakref.ref(runner.cache.k[0]), weakref.ref(next(runner.model.parameters()))]
        assert llm.closed and [ref() is None for ref in held] == [True, True]
    assert outs[0] == outs[1] and all(len(t) == 20 for t in outs[0])
