"""The engine against Hugging Face transformers: `generate` under `full`, and a dense reference
(whole-sequence forward with a 4-D mask built here from DESIGN.md's rule) under every bounded policy."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from rollout import LLM, SamplingParams

GREEDY = dict(temperature=0.0, ignore_eos=True)


def hf_model(path):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    return model.eval()


# ---- the rule, written out independently of rollout.kv_policy --------------------------------
def dense_visibility(spec: str, prompt_len: int, tokens: list[int], reg_ids=(), end_think=None) -> torch.Tensor:
    """[T, T] bool: may query position q attend to key position k (DESIGN.md's table)."""
    t = len(tokens)
    q = torch.arange(t)[:, None]
    k = torch.arange(t)[None, :]
    causal = k <= q
    kind, *args = spec.split(":")
    if kind == "full":
        return causal
    if kind == "prefix_sliding":
        return causal & ((k < prompt_len) | (q - k < int(args[0])))
    if kind == "sliding_window":
        return causal & (q - k < int(args[0]))
    if kind == "streaming":
        return causal & ((k < int(args[0])) | (q - k < int(args[1])))
    assert kind == "registers"
    visible = causal.clone()
    for start, end, killed_at in dead_steps(prompt_len, tokens, reg_ids, end_think):
        visible[killed_at:, start:end] = False
    return visible


def dead_steps(prompt_len, tokens, reg_ids, end_think):
    """(start, end, r): the step [start, end) is dead for queries at r and later."""
    steps = []  # [register, start, end]
    for pos in range(prompt_len, len(tokens)):
        tok = tokens[pos]
        if tok in reg_ids or tok == end_think:
            if steps and steps[-1][2] is None:
                steps[-1][2] = pos
        if tok in reg_ids:
            steps.append([tok, pos, None])
    dead, holder = [], {}
    for reg, start, end in steps:
        if reg in holder:
            prev_start, prev_end = holder[reg]
            dead.append((prev_start, prev_end, start))
        holder[reg] = (start, end)
    return dead


def reference_logprobs(model, tokens: list[int], visible: torch.Tensor) -> torch.Tensor:
    """log-softmax over the whole sequence with an additive 4-D mask: [T, V] float64."""
    mask = torch.zeros(visible.shape, dtype=torch.float32).masked_fill(~visible, float("-inf"))
    with torch.no_grad():
        logits = model(torch.tensor([tokens]), attention_mask=mask[None, None],
                       position_ids=torch.arange(len(tokens))[None]).logits[0]
    return torch.log_softmax(logits.double(), dim=-1)


def assert_matches_reference(model, out, visible):
    """Every generated token is the reference's argmax given the same prefix, and logprobs agree."""
    tokens = out.prompt_token_ids + out.token_ids
    ref = reference_logprobs(model, tokens, visible)
    p = len(out.prompt_token_ids)
    rows = ref[p - 1:len(tokens) - 1]
    assert rows.argmax(-1).tolist() == out.token_ids
    picked = rows.gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
    assert (picked - torch.tensor(out.logprobs, dtype=torch.float64)).abs().max() < 1e-4


# ---- full attention: token-identical to transformers' generate -------------------------------
@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "llama"])
def test_full_matches_transformers_generate(tiny_model_factory, arch):
    path = tiny_model_factory(arch=arch)
    llm = LLM(path, kv="full", block_size=4, num_blocks=256)
    prompts = [[5, 17, 99, 3], [42] * 11, list(range(60, 83)), [7]]
    outs = llm.generate(prompts, SamplingParams(max_tokens=64, **GREEDY))
    model = hf_model(path)
    for prompt, out in zip(prompts, outs):
        gen = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=64, min_new_tokens=64,
                             output_logits=True, return_dict_in_generate=True, eos_token_id=None, pad_token_id=0)
        assert out.token_ids == gen.sequences[0, len(prompt):].tolist()
        hf_lp = torch.stack([torch.log_softmax(s[0].double(), -1)[t] for s, t in zip(gen.logits, out.token_ids)])
        assert (hf_lp - torch.tensor(out.logprobs, dtype=torch.float64)).abs().max() < 1e-4
        assert out.finish_reason == "length" and len(out.token_ids) == 64


# ---- bounded policies: token-identical to the dense masked reference -------------------------
@pytest.mark.parametrize("spec", ["prefix_sliding:8", "sliding_window:8", "streaming:2:8", "prefix_sliding:13"])
def test_windowed_policies_match_dense_reference(tiny_model_factory, spec):
    path = tiny_model_factory(arch="qwen3")
    window = int(spec.split(":")[-1])
    llm = LLM(path, kv=spec, block_size=4, num_blocks=128, max_num_batched_tokens=7)  # chunked prefill too
    prompts = [[11, 12, 13, 14, 15, 16], list(range(100, 121))]
    outs = llm.generate(prompts, SamplingParams(max_tokens=5 * window + 3, **GREEDY))
    model = hf_model(path)
    for out in outs:
        tokens = out.prompt_token_ids + out.token_ids
        assert_matches_reference(model, out, dense_visibility(spec, len(out.prompt_token_ids), tokens))
        # the window really cut something: the full-attention argmax differs somewhere in the trace
    full = dense_visibility("full", 0, outs[0].prompt_token_ids + outs[0].token_ids)
    ref_full = reference_logprobs(model, outs[0].prompt_token_ids + outs[0].token_ids, full)
    ref_win = reference_logprobs(model, outs[0].prompt_token_ids + outs[0].token_ids,
                                 dense_visibility(spec, 6, outs[0].prompt_token_ids + outs[0].token_ids))
    assert (ref_full - ref_win).abs().max() > 1e-3


def test_window_counts_the_query_itself(tiny_model_factory):
    """`q - k < W`: under sliding_window:1 a token sees only itself, so its logits do not depend on the past."""
    path = tiny_model_factory(arch="qwen3")
    llm = LLM(path, kv="sliding_window:1", block_size=4, num_blocks=64)
    a, b = llm.generate([[3, 4, 5, 9], [77, 9]], SamplingParams(max_tokens=4, **GREEDY))
    assert a.token_ids == b.token_ids and a.logprobs[0] == pytest.approx(b.logprobs[0], abs=1e-5)


# ---- bounded memory ---------------------------------------------------------------------------
def test_prefix_sliding_memory_is_bounded(tiny_model_factory):
    path = tiny_model_factory(arch="qwen3")
    w, bs = 12, 4
    llm = LLM(path, kv=f"prefix_sliding:{w}", block_size=bs, num_blocks=64)
    prompts = [list(range(30, 37)), list(range(50, 52))]  # P = 7 and 2
    outs = llm.generate(prompts, SamplingParams(max_tokens=20 * w, **GREEDY))
    for out in outs:
        p = len(out.prompt_token_ids)
        assert len(out.token_ids) == 20 * w
        assert out.kv.peak_blocks <= math.ceil(p / bs) + math.ceil(w / bs) + 1
        assert out.kv.peak_visible_tokens == p + w  # reached once the window is full, never exceeded
        # mean over 240 queries at positions p-1 … p+238: min(q+1, p+w) visible each
        expected = sum(min(q + 1, p + w) for q in range(p - 1, p - 1 + 20 * w)) / (20 * w)
        assert out.kv.mean_visible_tokens == pytest.approx(expected)
    assert llm.scheduler.blocks.num_free == 64  # everything returned at the end
