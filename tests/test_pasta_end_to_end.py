"""The engine's Pasta runtime and the trainer's ``PastaLayout`` are one rule: a response the runtime decoded
(forks, a join, a never-joined fork, a promise without ``tokens``) is scored by the trainer — from the
flattened token ids alone — with the logprobs the sampler gave each sampled token."""

from __future__ import annotations

import torch
from test_pasta_runtime import GREEDY, RESPONSE_A, RESPONSE_B, lay_out, pasta_llm, pasta_model, run_scripted  # noqa: F401 (fixture)

from sliderl.core.kv_policy import KVPolicy
from sliderl.core.loader import load_model
from sliderl.core.pasta import PastaLayout, PastaTokenIds
from sliderl.rollout import SamplingParams
from sliderl.trainer.logprobs import recompute_logprobs


# catches: the trainer and the runtime disagreeing on any part of the rule — positions (the shift past a
# promise's predicted length), the thread mask, which token predicts which (a promise's "/>" predicting the
# first main token after its block) — so the learner would train on logprobs the sampler never had.
# Planted: PastaLayout without the position shift, and with forks exposed before their sync: both fail.
def test_trainer_rescores_runtime_traces_with_the_samplers_logprobs(pasta_model):
    llm = pasta_llm(pasta_model, num_blocks=256, max_num_batched_tokens=16)
    tags = PastaTokenIds.from_tokenizer(llm.tokenizer)
    prompts = [list(range(40, 61)), list(range(70, 75))]
    requests = [(p, r, SamplingParams(max_tokens=len(lay_out(r, tags, len(p)).main), **GREEDY))
                for p, r in zip(prompts, (RESPONSE_A, RESPONSE_B))]
    outs, _ = run_scripted(llm, requests)
    model = load_model(pasta_model, dtype=torch.float32)
    policy = KVPolicy.parse("pasta")
    for prompt, out in zip(prompts, outs):
        layout = PastaLayout.parse(len(prompt), out.token_ids, tags, llm.tokenizer.decode)
        assert len(layout.forks) == len(out.pasta.forks) >= 1
        with torch.no_grad():
            trainer = recompute_logprobs(model, prompt, out.token_ids, policy, temperature=1.0, backend="dense",
                                         layout=layout)
        sampled = ~torch.tensor(out.forced)  # the runtime's own <async> / </async> were never sampled
        diff = (trainer - torch.tensor(out.logprobs))[sampled].abs()
        assert sampled.sum() > 20 and diff.max() < 1e-4, diff.max()


# catches: the parser and the runtime disagreeing on an <async> the main thread samples right after a "/>" that
# forked nothing (a promise past pasta_max_forks): the runtime reads it as plain main-thread text, and the
# trainer's layout, given the trace's forced flags, must too — else it opens a fork the runtime never ran and
# rescores every later token under other threads and positions. Planted: the forced flags ignored by
# PastaLayout's parser (a second fork, the threads differ) -> fails.
def test_a_sampled_async_after_an_unforked_promise_is_main_thread_text_to_both(pasta_model):
    from test_pasta_runtime import SYNC, Promise

    llm = pasta_llm(pasta_model, num_blocks=256, pasta_max_forks=1)
    tags = PastaTokenIds.from_tokenizer(llm.tokenizer)
    pieces = [Promise(' tokens="1"', "ab"), "c", Promise(' tokens="2"', "zz", forks=False), [tags.async_open], "de",
              [tags.async_close], "f", SYNC, "g"]
    prompt = list(range(50, 56))
    expected = lay_out(pieces, tags, len(prompt))
    (out,), _ = run_scripted(llm, [(prompt, pieces, SamplingParams(max_tokens=len(expected.main), **GREEDY))])
    assert out.token_ids == expected.flat and out.pasta.counts.promises_over_limit == 1 and len(out.pasta.forks) == 1
    layout = PastaLayout.parse(len(prompt), out.token_ids, tags, llm.tokenizer.decode, out.forced)
    assert layout.thread.tolist() == [0] * len(prompt) + expected.thread
    assert layout.positions.tolist()[len(prompt):] == expected.positions
    assert [(f.promise, f.block, f.join) for f in layout.forks] == [
        (f.promise, f.block, f.join) for f in out.pasta.forks]
    with torch.no_grad():
        trainer = recompute_logprobs(load_model(pasta_model, dtype=torch.float32), prompt, out.token_ids,
                                     KVPolicy.parse("pasta"), temperature=1.0, backend="dense", layout=layout)
    sampled = ~torch.tensor(out.forced)
    assert (trainer - torch.tensor(out.logprobs))[sampled].abs().max() < 1e-4
