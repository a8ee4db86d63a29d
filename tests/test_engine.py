"""The engine against Hugging Face transformers: `generate` under `full`, and a dense reference
(whole-sequence forward with a 4-D mask built here from DESIGN.md's rule) under every bounded policy."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from sliderl.rollout import LLM, SamplingParams

GREEDY = dict(temperature=0.0, ignore_eos=True)


def hf_model(path):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    return model.eval()


# ---- the rule, written out independently of core.kv_policy --------------------------------
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
    """Every sampled (not forced) token is the reference's argmax given the same prefix, and logprobs agree."""
    tokens = out.prompt_token_ids + out.token_ids
    ref = reference_logprobs(model, tokens, visible)
    p = len(out.prompt_token_ids)
    rows = ref[p - 1:len(tokens) - 1]
    argmax = rows.argmax(-1).tolist()
    forced = out.forced or [False] * len(out.token_ids)
    assert [a if not f else t for a, t, f in zip(argmax, out.token_ids, forced)] == out.token_ids
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


# ---- registers (TIP) --------------------------------------------------------------------------
def test_registers_match_dense_reference_and_free_dead_blocks(register_model):
    bs = 4
    llm = LLM(register_model, kv="registers:3", block_size=bs, num_blocks=256)
    reg_ids, end_think = llm.policy.register_ids, llm.tokenizer.convert_tokens_to_ids("</think>")
    params = SamplingParams(max_tokens=80, max_thinking_tokens=50, **GREEDY)  # forces </think> at token 50
    seqs = [llm.add_request(p, params) for p in ([5, 6, 7], [90, 91, 92, 93, 94])]
    while llm.scheduler.has_unfinished():
        llm.step()
        for seq in seqs:  # after every step: no held block is wholly dead for the next query
            if seq.blocks:
                tokens, nxt = seq.token_ids, seq.num_computed
                vis = dense_visibility("registers", seq.prompt_len, tokens, reg_ids, end_think)
                alive = vis[min(nxt, len(tokens) - 1)]  # what the next query (or the last token) may see
                for j in seq.blocks:
                    positions = range(j * bs, min((j + 1) * bs, nxt))
                    if len(positions) == bs:
                        assert any(alive[p] for p in positions), f"block {j} is wholly dead but still held"
        held = sum(len(s.blocks) for s in seqs)
        assert llm.scheduler.blocks.num_free + held == 256
    model = hf_model(register_model)
    for seq in seqs:
        out = llm.output(seq)
        tokens = out.prompt_token_ids + out.token_ids
        dead = dead_steps(len(out.prompt_token_ids), tokens, reg_ids, end_think)
        assert len(dead) >= 5, "the test needs register reuse to mean anything"
        assert out.token_ids[50] == end_think and out.forced[50]
        assert_matches_reference(model, out, dense_visibility("registers", len(out.prompt_token_ids), tokens,
                                                              reg_ids, end_think))
        assert out.kv.peak_visible_tokens < len(tokens) - 1
    assert llm.scheduler.blocks.num_free == 256


def test_registers_added_to_tokenizer_when_missing(tiny_model_factory):
    path = tiny_model_factory(arch="qwen3")
    llm = LLM(path, kv="registers:4", block_size=4, num_blocks=64)
    ids = llm.tokenizer.convert_tokens_to_ids([f"<reg_{i}>" for i in range(4)])
    assert list(llm.policy.register_ids) == ids and len(set(ids)) == 4
    assert llm.tokenizer.decode([ids[2]]) == "<reg_2>" and llm.tokenizer.encode("<reg_3>", add_special_tokens=False) == [ids[3]]
    assert llm.model.config.vocab_size >= max(ids) + 1
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=8, **GREEDY))[0]
    assert len(out.token_ids) == 8


# ---- continuous batching and preemption -------------------------------------------------------
def test_continuous_batching_with_preemption_equals_running_alone(tiny_model_factory):
    path = tiny_model_factory(arch="qwen3")
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (int(n),), generator=gen).tolist() for n in torch.randint(1, 30, (64,), generator=gen)]
    params = [SamplingParams(max_tokens=int(m), **GREEDY) for m in torch.randint(1, 40, (64,), generator=gen)]
    # 24 blocks of 4 = 96 token slots, far less than 64 requests need together
    llm = LLM(path, kv="full", block_size=4, num_blocks=24, max_num_seqs=32, max_num_batched_tokens=64)
    outs = llm.generate(prompts, params)
    assert llm.stats.preemptions > 0
    assert sum(o.num_preemptions for o in outs) == llm.stats.preemptions
    alone = LLM(path, kv="full", block_size=4, num_blocks=64)
    for prompt, sp, out in zip(prompts, params, outs):
        ref = alone.generate([prompt], sp)[0]
        assert out.token_ids == ref.token_ids and len(out.token_ids) == sp.max_tokens
        assert out.logprobs == pytest.approx(ref.logprobs, abs=1e-5)
    assert llm.scheduler.blocks.num_free == 24


def test_chunked_prefill_equals_one_shot(tiny_model_factory):
    path = tiny_model_factory(arch="qwen3")
    prompt = list(range(1, 200))
    a = LLM(path, kv="prefix_sliding:16", block_size=4, num_blocks=256, max_num_batched_tokens=13)
    b = LLM(path, kv="prefix_sliding:16", block_size=4, num_blocks=256, max_num_batched_tokens=4096)
    sp = SamplingParams(max_tokens=40, **GREEDY)
    oa, ob = a.generate([prompt], sp)[0], b.generate([prompt], sp)[0]
    assert oa.token_ids == ob.token_ids and oa.logprobs == pytest.approx(ob.logprobs, abs=1e-5)


# ---- overlap: the next decode step queued before this one's tokens are read ------------------
def overlap_workload(gen: torch.Generator):
    """Mixed requests: greedy and seeded sampling, eos on/off, stop tokens, lengths that end at different steps."""
    prompts = [torch.randint(1, 256, (int(n),), generator=gen).tolist() for n in torch.randint(1, 20, (12,), generator=gen)]
    params = []
    for i, m in enumerate(torch.randint(3, 40, (12,), generator=gen).tolist()):
        sampled = dict(temperature=0.9, top_k=40 if i % 3 == 0 else -1, seed=i) if i % 2 else dict(temperature=0.0)
        params.append(SamplingParams(max_tokens=m, ignore_eos=i % 4 != 1, stop_token_ids=[7] if i % 5 == 0 else None,
                                     **sampled))
    return prompts, params


@pytest.mark.parametrize("spec", ["full", "prefix_sliding:8", "sliding_window:8", "streaming:2:8", "registers:4"])
def test_overlapped_steps_equal_serial_steps(tiny_model_factory, spec):
    path = tiny_model_factory(arch="qwen3")
    prompts, params = overlap_workload(torch.Generator().manual_seed(3))
    runs = {}
    for overlap in (False, True):
        llm = LLM(path, kv=spec, block_size=4, num_blocks=256, overlap=overlap)
        runs[overlap] = (llm.generate(prompts, params), llm)
    (serial, _), (overlapped, llm) = runs[False], runs[True]
    assert llm.stats.queued_ahead > 0
    for a, b in zip(serial, overlapped):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
        # a request's last queued step may hold one block more (for a token that was never sampled)
        assert a.kv.peak_visible_tokens == b.kv.peak_visible_tokens and a.kv.mean_visible_tokens == b.kv.mean_visible_tokens
        assert a.kv.peak_blocks <= b.kv.peak_blocks <= a.kv.peak_blocks + 1
    assert llm.scheduler.blocks.num_free == 256  # rows wasted on finished sequences leaked no block


def test_overlapped_register_kills_mask_the_killed_step_in_the_queued_step(register_model):
    """A register kill is known on the host only after the next step was queued: that step masks the killed step
    itself (kernels.metadata.register_kills, from its input tokens on the device). Catches a queued step that
    attends to the step its own input register killed (planted: register_kills returning no kill, the greedy rows'
    tokens leave the dense reference's argmax and the serial run's), and ranges followed wrong by the tracker."""
    prompts = [[5, 6, 7], [90, 91, 92, 93, 94], [40] * 9, [3, 1]]
    params = [SamplingParams(max_tokens=60, **GREEDY), SamplingParams(max_tokens=45, **GREEDY),
              SamplingParams(max_tokens=60, temperature=0.8, seed=3, ignore_eos=True),
              SamplingParams(max_tokens=33, **GREEDY)]
    runs = {}
    for overlap in (False, True):
        llm = LLM(register_model, kv="registers:3", block_size=4, num_blocks=256, overlap=overlap)
        runs[overlap] = (llm.generate(prompts, params), llm)
    (serial, _), (overlapped, llm) = runs[False], runs[True]
    assert llm.stats.queued_ahead > 0 and llm.stats.register_kills > 0  # kills met queued steps: the mask was used
    reg_ids, end_think = llm.policy.register_ids, llm.tokenizer.convert_tokens_to_ids("</think>")
    model = hf_model(register_model)
    for a, b, sp in zip(serial, overlapped, params):
        assert a.token_ids == b.token_ids and a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
        assert (a.kv.peak_visible_tokens, a.kv.mean_visible_tokens) == (b.kv.peak_visible_tokens, b.kv.mean_visible_tokens)
        tokens = b.prompt_token_ids + b.token_ids
        if sp.temperature == 0:  # greedy rows: every token is the dense reference's argmax
            assert len(dead_steps(len(b.prompt_token_ids), tokens, reg_ids, end_think)) >= 3
            assert_matches_reference(model, b, dense_visibility("registers", len(b.prompt_token_ids), tokens,
                                                                reg_ids, end_think))
    assert llm.scheduler.blocks.num_free == 256


def test_overlap_drops_the_queued_step_when_weights_change(tiny_model_factory):
    path = tiny_model_factory(arch="qwen2")
    new = {k: v + 0.05 for k, v in hf_model(path).state_dict().items()}
    outs = {}
    for overlap in (False, True):
        llm = LLM(path, kv="prefix_sliding:8", block_size=4, num_blocks=64, overlap=overlap)
        seqs = [llm.add_request(p, SamplingParams(max_tokens=20, **GREEDY)) for p in ([5, 6, 7], [1, 2])]
        for _ in range(6):
            llm.step()
        llm.load_weights(new)
        while llm.scheduler.has_unfinished():
            llm.step()
        outs[overlap] = [llm.output(s).token_ids for s in seqs]
        assert (llm.stats.queued_ahead > 0) == overlap
    assert outs[True] == outs[False]


# ---- sampling through the engine --------------------------------------------------------------
def test_seeded_sampling_is_reproducible_and_batch_independent(tiny_model_factory):
    path = tiny_model_factory(arch="qwen3")
    llm = LLM(path, kv="prefix_sliding:8", block_size=4, num_blocks=128)
    sp = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, top_k=50, seed=7, ignore_eos=True)
    alone = llm.generate([[4, 5, 6]], sp)[0]
    crowd = llm.generate([[9, 9], [4, 5, 6], [1]], [SamplingParams(max_tokens=5, seed=1), sp, sp])[1]
    assert alone.token_ids == crowd.token_ids
    other = llm.generate([[4, 5, 6]], SamplingParams(max_tokens=24, temperature=0.9, seed=8, ignore_eos=True))[0]
    assert other.token_ids != alone.token_ids


def test_temperature_one_logprobs_are_model_log_softmax(tiny_model_factory):
    path = tiny_model_factory(arch="llama")
    llm = LLM(path, kv="full", block_size=4, num_blocks=64)
    out = llm.generate([[3, 1, 4, 1, 5]], SamplingParams(max_tokens=20, temperature=1.0, seed=3, ignore_eos=True))[0]
    ref = reference_logprobs(hf_model(path), out.prompt_token_ids + out.token_ids,
                             dense_visibility("full", 0, out.prompt_token_ids + out.token_ids))
    picked = ref[4:-1].gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
    assert (picked - torch.tensor(out.logprobs, dtype=torch.float64)).abs().max() < 1e-4


# ---- stopping ---------------------------------------------------------------------------------
def test_stop_strings_and_stop_tokens(tiny_model_factory):
    path = tiny_model_factory(arch="qwen3")
    llm = LLM(path, kv="full", block_size=4, num_blocks=64)
    free = llm.generate([[10, 20, 30]], SamplingParams(max_tokens=40, **GREEDY))[0]
    stop_tok = free.token_ids[12]
    first = free.token_ids.index(stop_tok)
    by_token = llm.generate([[10, 20, 30]], SamplingParams(max_tokens=40, stop_token_ids=[stop_tok], **GREEDY))[0]
    assert by_token.token_ids == free.token_ids[:first + 1] and by_token.finish_reason == "stop"
    text = free.text
    needle = text[len(text) // 2:len(text) // 2 + 2]
    by_string = llm.generate([[10, 20, 30]], SamplingParams(max_tokens=40, stop=[needle], **GREEDY))[0]
    assert by_string.finish_reason == "stop" and by_string.text == text[:text.index(needle)]


def test_budget_forcing_ends_thinking(tiny_model_factory):
    path = tiny_model_factory(arch="qwen3")
    llm = LLM(path, kv="prefix_sliding:8", block_size=4, num_blocks=64)
    end = llm.tokenizer.convert_tokens_to_ids("</think>")
    free = llm.generate([[p, p + 1] for p in range(1, 40)], SamplingParams(max_tokens=13, **GREEDY))
    prompt = next(o.prompt_token_ids for o in free if end not in o.token_ids)  # never ends thinking alone
    out = llm.generate([prompt], SamplingParams(max_tokens=30, max_thinking_tokens=12, **GREEDY))[0]
    assert out.token_ids[:12] == free[prompt[0] - 1].token_ids[:12]
    assert out.token_ids[12] == end and out.forced == [False] * 12 + [True] + [False] * 17
    assert "</think>" in out.text and len(out.token_ids) == 30


# ---- weights ----------------------------------------------------------------------------------
def test_load_weights_changes_generation_like_transformers(tiny_model_factory):
    path = tiny_model_factory(arch="qwen2")
    llm = LLM(path, kv="full", block_size=4, num_blocks=64)
    model = hf_model(path)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for param in model.parameters():  # tied embeddings are one parameter: perturbed once
            param.add_(0.05 * torch.randn(param.shape, generator=gen))
    llm.load_weights(model.state_dict())
    out = llm.generate([[8, 9, 10]], SamplingParams(max_tokens=32, **GREEDY))[0]
    ref = model.generate(torch.tensor([[8, 9, 10]]), do_sample=False, max_new_tokens=32, min_new_tokens=32,
                         eos_token_id=None, pad_token_id=0)
    assert out.token_ids == ref[0, 3:].tolist()


# ---- bad input --------------------------------------------------------------------------------
@pytest.mark.parametrize("spec, message", [
    ("lru:4", "unknown KV policy 'lru'"),
    ("prefix_sliding", "takes 1 integer argument"),
    ("prefix_sliding:abc", "non-integer"),
    ("sliding_window:0", "window must be >= 1, got 0"),
    ("prefix_sliding:-5", "window must be >= 1, got -5"),
    ("streaming:4", "takes 2 integer argument"),
    ("registers:0", "number of registers must be >= 1"),
])
def test_bad_policy_specs_are_rejected(tiny_model_factory, spec, message):
    with pytest.raises(ValueError, match=message):
        LLM(tiny_model_factory(arch="qwen3"), kv=spec)


def test_bad_requests_are_rejected(tiny_model_factory, tmp_path):
    path = tiny_model_factory(arch="qwen3", max_position_embeddings=64)
    llm = LLM(path, kv="full", block_size=4, num_blocks=64)
    with pytest.raises(ValueError, match="prompt of 64 tokens does not fit max_model_len=64"):
        llm.generate([[1] * 64], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="max_tokens must be an integer >= 1, got 0"):
        SamplingParams(max_tokens=0)
    with pytest.raises((FileNotFoundError, ValueError), match="does-not-exist"):
        LLM(tmp_path / "does-not-exist")
    (tmp_path / "empty").mkdir()
    with pytest.raises((FileNotFoundError, ValueError), match="config.json"):
        LLM(tmp_path / "empty")
