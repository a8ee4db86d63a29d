"""The trainer rescores engine traces under the trace's KV policy and gets the sampler's logprobs back.

The independent reference is the engine itself (paged KV cache, incremental decode, CPU reference
attention): traces are generated in fp32 under every policy and the trainer's teacher-forced
recomputation over the whole trace must match the sampler's logprobs within 1e-4. A deliberately
wrong policy must not. Truncation is checked against the receptive field worked out by hand.
"""

from __future__ import annotations

import math

import pytest
import torch

from sliderl.core.loader import load_model, load_tokenizer
from sliderl.core.vocab import bind_policy_vocab
from sliderl.rollout import LLM, SamplingParams
from sliderl.trainer.logprobs import logprob_mismatch, pack_windows, packed_logprobs, recompute_logprobs, window_input
from sliderl.trainer.windows import chunked_windows, truncated_window

PROMPTS = [[11, 12, 13, 14, 15, 16], list(range(100, 113))]


def trainer_model(path, spec):
    """A fresh model and policy as the learner builds them (not the engine's objects)."""
    model, tokenizer = load_model(path), load_tokenizer(path)
    return model, bind_policy_vocab(spec, tokenizer, model)


def generate(path, spec, max_tokens, **extra):
    llm = LLM(path, kv=spec, block_size=4, num_blocks=256)
    params = [SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=5, ignore_eos=True, **extra),
              SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **extra)]
    return llm.generate(PROMPTS, params), params


def max_abs_error(model, policy, out, temperature):
    with torch.no_grad():
        lp = recompute_logprobs(model, out.prompt_token_ids, out.token_ids, policy, temperature=temperature)
    return (lp.double() - torch.tensor(out.logprobs, dtype=torch.float64)).abs().max().item()


@pytest.mark.parametrize("spec, wrong", [
    ("full", "sliding_window:4"),
    ("prefix_sliding:8", "full"),
    ("sliding_window:8", "prefix_sliding:8"),
    ("streaming:2:8", "sliding_window:8"),
])
def test_whole_trace_logprobs_match_the_sampler(tiny_model_factory, spec, wrong):
    path = tiny_model_factory(arch="qwen3")
    outs, params = generate(path, spec, max_tokens=40)
    model, policy = trainer_model(path, spec)
    _, wrong_policy = trainer_model(path, wrong)
    for out, sp in zip(outs, params):
        assert len(out.token_ids) == 40
        assert max_abs_error(model, policy, out, sp.temperature) < 1e-4
        assert max_abs_error(model, wrong_policy, out, sp.temperature) > 1e-2  # the mask matters


def test_register_trace_logprobs_match_the_sampler(register_model):
    spec = "registers:3"
    llm = LLM(register_model, kv=spec, block_size=4, num_blocks=256)
    params = SamplingParams(max_tokens=80, max_thinking_tokens=50, temperature=0.0, ignore_eos=True)
    outs = llm.generate(PROMPTS, params)
    model, policy = trainer_model(register_model, spec)
    assert policy.register_ids == llm.policy.register_ids and policy.end_think_id == llm.policy.end_think_id
    _, full = trainer_model(register_model, "full")
    for out in outs:
        tokens = out.prompt_token_ids + out.token_ids
        assert sum(t in policy.register_ids for t in out.token_ids) >= 6  # registers are reused: steps die
        assert out.forced[50]  # budget forcing inserted </think>; its logprob is rescored too
        death = policy.death_positions(len(out.prompt_token_ids), tokens)
        assert (death < len(tokens)).sum() > 0
        assert max_abs_error(model, policy, out, 0.0) < 1e-4
        assert max_abs_error(model, full, out, 0.0) > 1e-2


def test_registers_grow_the_vocabulary_like_the_engine(tiny_model_factory):
    """A tokenizer without <reg_i>: the trainer adds them and mean-initialises the rows as the engine does."""
    path = tiny_model_factory(arch="qwen3")
    llm = LLM(path, kv="registers:2", block_size=4, num_blocks=64)
    model, policy = trainer_model(path, "registers:2")
    assert policy.register_ids == llm.policy.register_ids
    assert model.config.vocab_size == llm.model.config.vocab_size
    rows = model.model.embed_tokens.weight
    assert torch.equal(rows, llm.model.model.embed_tokens.weight)
    assert torch.allclose(rows[-1], rows[:-2].mean(0), atol=1e-6)  # the new rows are the old mean row


# ---- truncated and chunked windows on a real trace ------------------------------------------------
@pytest.fixture(scope="module")
def long_trace(tiny_model_factory):
    """A prefix_sliding:8 trace of 100 generated tokens, much longer than k·W = 32 for every k here."""
    path = tiny_model_factory(arch="qwen3")
    llm = LLM(path, kv="prefix_sliding:8", block_size=4, num_blocks=256)
    out = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=100, temperature=0.8, seed=2, ignore_eos=True))[0]
    model, policy = trainer_model(path, "prefix_sliding:8")
    return model, policy, out


def window_logprobs(model, policy, out, window):
    with torch.no_grad():
        lp = recompute_logprobs(model, out.prompt_token_ids, out.token_ids, policy, temperature=0.8, window=window)
    behaviour = torch.tensor(out.logprobs)[window.target_start:window.target_end]
    return lp, behaviour


def test_truncated_window_mismatch_follows_the_receptive_field(long_trace):
    """2 layers of prefix_sliding:8: a token's logits depend on the prompt and the last 2·(8-1) = 14 positions.

    k=4: the first loss target's predecessor (position P+T-9) needs positions >= P+T-23, and the
    window feeds from P+T-33 -> exact. k=1: it feeds from P+T-9 only -> the loss tokens miss context.
    """
    model, policy, out = long_trace
    p, t = len(out.prompt_token_ids), len(out.token_ids)
    kl = {}
    for k in (1, 2, 4):
        w = truncated_window(p, t, 8, multiplier=k)
        assert w.input_positions().tolist() == list(range(p)) + list(range(p + t - 8 * k - 1, p + t - 1))
        assert w.target_positions().tolist() == list(range(p + t - 8 * k, p + t))
        assert w.loss_mask().tolist() == [False] * (8 * k - 8) + [True] * 8
        lp, behaviour = window_logprobs(model, policy, out, w)
        mismatch = logprob_mismatch(behaviour, lp, w.loss_mask())
        assert math.isfinite(mismatch.kl) and mismatch.kl >= 0 and mismatch.num_tokens == 8
        kl[k] = mismatch
    assert kl[4].max_abs < 1e-4
    assert kl[1].max_abs > 1e-3 and kl[1].kl > kl[4].kl


def test_chunked_windows_cover_the_trace_and_match_with_enough_context(long_trace):
    model, policy, out = long_trace
    p, t = len(out.prompt_token_ids), len(out.token_ids)
    windows = chunked_windows(p, t, 8, multiplier=4)
    items = [window_input(out.prompt_token_ids, out.token_ids, policy, 0.8, w) for w in windows]
    packed = pack_windows(items)  # all 13 windows in one stream, one document each
    with torch.no_grad():
        per_window = packed.split(packed_logprobs(model, packed))
    scored = torch.full((t,), math.nan, dtype=torch.float64)
    for w, lp in zip(windows, per_window):
        loss = w.loss_mask()
        j = w.target_positions()[loss] - p
        assert scored[j].isnan().all()  # no token gets a second loss
        scored[j] = lp[loss].double()
    assert not scored.isnan().any()  # every token got one
    # (k-1)·W = 24 context targets cover the 14-token receptive field: every logprob is exact
    assert (scored - torch.tensor(out.logprobs, dtype=torch.float64)).abs().max() < 1e-4



def test_logprobs_in_vocabulary_chunks_equal_the_whole_logits_with_their_gradients(long_trace):
    # Catches a chunked loss (packed_logprobs scoring the LM head a chunk of targets at a time under
    # checkpointing, so [M, V] float32 logits are never held whole) that misaligns targets with their
    # hidden states, drops the last partial chunk, scores a chunk at the wrong temperature, or loses
    # the gradient through the recomputed chunks. 7-row chunks (so the last is partial) against the
    # whole logits: same logprobs, same gradient on every weight. Planted by splitting the targets one
    # row off the hidden states, or by detaching the chunks, this fails.
    model, policy, out = long_trace
    p = len(out.prompt_token_ids)
    items = [window_input(out.prompt_token_ids, out.token_ids, policy, t, w)
             for t, w in ((0.8, chunked_windows(p, len(out.token_ids), 8, multiplier=4)[0]), (0.0, None))]
    packed = pack_windows(items)
    weights = torch.randn(int(packed.target_ids.shape[0]), generator=torch.Generator().manual_seed(0))
    results = []
    for rows in (10**9, 7):
        model.zero_grad(set_to_none=True)
        lp = packed_logprobs(model, packed, chunk_rows=rows)
        (lp * weights).sum().backward()
        results.append((lp.detach(), {n: q.grad.clone() for n, q in model.named_parameters()}))
    (whole, whole_grads), (chunked, chunked_grads) = results
    assert whole.shape[0] > 7 and whole.shape[0] % 7 != 0
    assert torch.allclose(chunked, whole, rtol=0, atol=1e-5)  # a 7-row GEMM rounds differently from an M-row one
    # float32 sums in another order: compare each weight's gradient to its own scale
    assert all((chunked_grads[n] - g).abs().max() <= 1e-5 * g.abs().max() for n, g in whole_grads.items())
    model.zero_grad(set_to_none=True)

def test_mismatch_estimators_by_hand():
    behaviour = torch.tensor([-1.0, -2.0, -3.0])
    recomputed = torch.tensor([-1.5, -2.0, 7.0])
    mask = torch.tensor([True, True, False])  # the third token is not a loss token
    m = logprob_mismatch(behaviour, recomputed, mask)
    # x = recomputed - behaviour = [-0.5, 0]; k3 = exp(x) - x - 1 = [0.60653 + 0.5 - 1, 0] = [0.10653, 0]
    assert m.kl == pytest.approx((math.exp(-0.5) - 0.5) / 2)
    assert m.kl_k1 == pytest.approx(0.25)  # mean(behaviour - recomputed) = (0.5 + 0) / 2
    assert m.max_abs == pytest.approx(0.5) and m.num_tokens == 2
    with pytest.raises(ValueError, match="selects no tokens"):
        logprob_mismatch(behaviour, recomputed, torch.zeros(3, dtype=torch.bool))
