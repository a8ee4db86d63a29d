"""DecoderLM, the HF-directory loader and the tiny-model builder, checked against transformers itself."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, Qwen2Config

from sliderl.core.loader import load_model, load_tokenizer
from sliderl.core.model import DecoderLM, DenseAttention, ModelConfig, causal_mask
from sliderl.core.tiny import build_tokenizer
from sliderl.core.tiny import main as tiny_main

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 256}
YARN_ROPE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 1024}
CASES = {
    "qwen3": ("qwen3", {}),
    "qwen3-yarn": ("qwen3", {"rope_parameters": YARN_ROPE}),
    "qwen2": ("qwen2", {}),  # q/k/v biases are always on in qwen2
    "llama-tied-biases": ("llama", {"attention_bias": True, "mlp_bias": True}),
    "llama-untied": ("llama", {"tie_word_embeddings": False}),
    "llama-llama3-rope": ("llama", {"rope_parameters": LLAMA3_ROPE, "tie_word_embeddings": False}),
}
VOCAB = 256  # the tiny tokenizer's byte ids


def tokens(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def hf_logits(hf, ids, positions=None, mask=None):
    """HF forward of one sequence. An explicit all-ones 2D mask stops HF from reading position gaps as
    packed-sequence boundaries; a 4D bool mask is used as given (sdpa)."""
    n = ids.numel()
    mask = torch.ones(1, n, dtype=torch.long) if mask is None else mask[None, None]
    pos = None if positions is None else positions[None]
    with torch.no_grad():
        return hf(ids[None], position_ids=pos, attention_mask=mask).logits[0].float()


def our_logits(model, ids, positions, mask=None):
    mask = causal_mask(ids.numel()) if mask is None else mask
    with torch.no_grad():
        return model.compute_logits(model(ids, positions, DenseAttention(mask)))


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(tiny_model_factory, case):
    arch, kw = CASES[case]
    path = tiny_model_factory(arch, **kw)
    model, hf = load_model(path), AutoModelForCausalLM.from_pretrained(path)
    ids = tokens(48)
    contiguous = torch.arange(48)
    shifted = torch.arange(48) + 100
    gapped = torch.cat([torch.arange(20), torch.arange(900, 928)])  # RoPE must use the given positions
    for positions in (contiguous, shifted, gapped):
        expected = hf_logits(hf, ids, positions)
        assert (our_logits(model, ids, positions) - expected).abs().max() <= 1e-4, (case, positions[:3])


def test_config_reads_each_family(tiny_model_factory):
    qwen3 = ModelConfig.from_hf(AutoModelForCausalLM.from_pretrained(tiny_model_factory("qwen3")).config)
    assert (qwen3.qk_norm, qwen3.qkv_bias, qwen3.head_dim, qwen3.num_kv_heads) == (True, False, 16, 2)
    qwen2 = load_model(tiny_model_factory("qwen2")).config
    assert (qwen2.qk_norm, qwen2.qkv_bias, qwen2.o_bias) == (False, True, False)
    llama = load_model(tiny_model_factory("llama", **CASES["llama-llama3-rope"][1])).config
    assert llama.rope_type == "llama3" and not llama.tie_word_embeddings


def test_packed_sequences_match_separate_hf_runs(tiny_model_factory):
    path = tiny_model_factory("qwen3")
    model, hf = load_model(path), AutoModelForCausalLM.from_pretrained(path)
    a, b = tokens(20, seed=1), tokens(28, seed=2)
    ids = torch.cat([a, b])
    positions = torch.cat([torch.arange(20), torch.arange(28)])
    mask = torch.block_diag(causal_mask(20), causal_mask(28))
    ours = our_logits(model, ids, positions, mask)
    expected = torch.cat([hf_logits(hf, a), hf_logits(hf, b)])
    assert (ours - expected).abs().max() <= 1e-4


def test_arbitrary_mask_matches_hf_with_the_same_4d_mask(tiny_model_factory):
    path = tiny_model_factory("llama", tie_word_embeddings=False)
    model, hf = load_model(path), AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa")
    n, prompt, window = 40, 6, 8
    q, k = torch.arange(n)[:, None], torch.arange(n)[None, :]
    mask = (k <= q) & ((k < prompt) | (q - k < window))  # prefix_sliding:8 with a 6-token prompt
    ids = tokens(n, seed=3)
    expected = hf_logits(hf, ids, torch.arange(n), mask)
    assert (our_logits(model, ids, torch.arange(n), mask) - expected).abs().max() <= 1e-4


def test_dense_attention_matches_sdpa_in_float64():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(12, h, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    mask = torch.rand(12, 12, generator=g) < 0.5
    mask |= torch.eye(12, dtype=torch.bool)
    out = DenseAttention(mask)(0, q, k, v)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, enable_gqa=True).transpose(0, 1)
    assert out.dtype == torch.float64
    assert torch.allclose(out, ref, atol=1e-12)


def test_sharded_checkpoint_loads_and_matches(tiny_model_factory):
    path = tiny_model_factory("qwen2", max_shard_size="40KB")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    model, hf = load_model(path), AutoModelForCausalLM.from_pretrained(path)
    ids = tokens(32)
    assert (our_logits(model, ids, torch.arange(32)) - hf_logits(hf, ids)).abs().max() <= 1e-4


def test_bf16_is_as_close_to_fp32_as_hf_bf16(tiny_model_factory):
    path = tiny_model_factory("qwen3")
    model = load_model(path, dtype=torch.bfloat16)
    assert model.model.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32
    ids = tokens(40)
    reference = hf_logits(AutoModelForCausalLM.from_pretrained(path), ids)
    hf_bf16 = hf_logits(AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16), ids)
    ours = our_logits(model, ids, torch.arange(40))
    assert ours.dtype == torch.float32
    hf_error = (hf_bf16 - reference).abs().max()
    assert (ours - reference).abs().max() <= 2 * hf_error + 0.02
    assert (ours - hf_bf16).abs().max() <= 0.1


def test_load_weights_in_place_matches_hf_with_the_new_state_dict(tiny_model_factory):
    path = tiny_model_factory("llama", tie_word_embeddings=False)
    model = load_model(path)
    other = AutoModelForCausalLM.from_pretrained(tiny_model_factory("llama", tie_word_embeddings=False, seed=7))
    weight = model.model.layers[1].mlp.up_proj.weight
    model.load_weights(other.state_dict())
    assert model.model.layers[1].mlp.up_proj.weight is weight  # same storage, updated in place
    ids = tokens(24)
    assert (our_logits(model, ids, torch.arange(24)) - hf_logits(other, ids)).abs().max() <= 1e-4
    model.load_weights((name, t.to(torch.bfloat16)) for name, t in other.state_dict().items())  # casts
    assert model.lm_head.weight.dtype == torch.float32
    assert torch.equal(model.lm_head.weight, other.lm_head.weight.to(torch.bfloat16).float())


def test_load_weights_rejects_unknown_names_and_bad_shapes(tiny_model_factory):
    model = load_model(tiny_model_factory("qwen3"))
    with pytest.raises(ValueError, match="model.layers.9.mlp.up_proj.weight"):
        model.load_weights({"model.layers.9.mlp.up_proj.weight": torch.zeros(128, 64)})
    with pytest.raises(ValueError, match=r"\(3, 3\).*\(128, 64\)"):
        model.load_weights({"model.layers.0.mlp.up_proj.weight": torch.zeros(3, 3)})


def test_tied_lm_head_follows_the_embedding(tiny_model_factory):
    model = load_model(tiny_model_factory("qwen3"))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert "lm_head.weight" not in model.weight_names()
    model.load_weights({"lm_head.weight": torch.zeros(model.config.vocab_size, 64)})  # ignored when tied
    assert model.lm_head.weight.abs().sum() > 0


def test_gradient_checkpointing_gives_hf_gradients(tiny_model_factory):
    path = tiny_model_factory("qwen3")
    model, hf = load_model(path), AutoModelForCausalLM.from_pretrained(path)
    model.train().gradient_checkpointing = True
    assert_hf_gradients(model, hf)


def assert_hf_gradients(model, hf) -> None:
    """Our training forward and transformers' over the same 24 tokens, each backpropagating the next-token loss;
    every parameter's gradient must be transformers' own."""
    hf.train()
    ids = tokens(24)
    ours = model.compute_logits(model(ids, torch.arange(24), DenseAttention(causal_mask(24))))
    torch.nn.functional.cross_entropy(ours[:-1], ids[1:]).backward()
    theirs = hf(ids[None], attention_mask=torch.ones(1, 24, dtype=torch.long)).logits[0]
    torch.nn.functional.cross_entropy(theirs[:-1], ids[1:]).backward()
    hf_params = dict(hf.named_parameters())
    for name, param in model.named_parameters():
        ref = hf_params[name].grad
        assert (param.grad - ref).abs().max() <= 1e-4 * (1 + ref.abs().max()), name


@pytest.mark.parametrize("checkpoint_layers, runs", [(1, [2, 1, 1]), (2, [2, 2, 1]), (0, [1, 1, 1]),
                                                    (5, [2, 2, 2]), (None, [2, 2, 2])])
def test_checkpoint_layers_recomputes_only_the_first_k(tiny_model_factory, checkpoint_layers, runs):
    # catches: checkpoint_layers ignored (every layer recomputed, or none), the count off by one or taken from the
    # end, and a partly checkpointed model whose gradients are not transformers' own. A layer's forward runs once in
    # the forward pass and once more in backward when it is recomputed (non-reentrant checkpointing calls the
    # module again, and stops it early once it has what backward needs: hence a pre-hook), so the hooks count
    # [2, 1, 1] for K = 1 of 3 layers; K past the layer count is "all".
    path = tiny_model_factory("qwen3", num_layers=3)
    model, hf = load_model(path), AutoModelForCausalLM.from_pretrained(path)
    model.train().gradient_checkpointing = True
    model.checkpoint_layers = checkpoint_layers
    calls = [0] * 3
    for i, layer in enumerate(model.model.layers):
        layer.register_forward_pre_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
    assert_hf_gradients(model, hf)
    assert calls == runs


def test_resize_vocab_adds_mean_rows(tiny_model_factory):
    path = tiny_model_factory("llama", tie_word_embeddings=False)
    model, hf = load_model(path), AutoModelForCausalLM.from_pretrained(path)
    old = model.config.vocab_size
    model.resize_vocab(old + 2)
    assert model.config.vocab_size == old + 2
    ids = tokens(16)
    expected = hf_logits(hf, ids)
    ours = our_logits(model, ids, torch.arange(16))
    assert (ours[:, :old] - expected).abs().max() <= 1e-4
    # a new lm_head row is the mean row, so its logit is the mean of the old logits
    assert (ours[:, old] - expected.mean(-1)).abs().max() <= 1e-4
    # a new token embeds as the mean embedding
    ids_new = torch.cat([ids[:8], torch.tensor([old + 1])])
    embeds = hf.model.embed_tokens(ids[None, :9]).detach()
    embeds[0, -1] = hf.model.embed_tokens.weight.mean(0)
    with torch.no_grad():
        ref = hf(inputs_embeds=embeds, attention_mask=torch.ones(1, 9, dtype=torch.long)).logits[0, -1]
    assert (our_logits(model, ids_new, torch.arange(9))[-1, :old] - ref).abs().max() <= 1e-4


def test_model_config_rejects_unsupported_architectures():
    with pytest.raises(ValueError, match="'gpt2'.*qwen3, qwen2, llama"):
        ModelConfig.from_hf(type("Cfg", (), {"model_type": "gpt2"})())
    sliding = Qwen2Config(hidden_size=64, num_attention_heads=4, num_hidden_layers=2, use_sliding_window=True,
                          max_window_layers=0)
    with pytest.raises(ValueError, match="sliding"):
        ModelConfig.from_hf(sliding)


@pytest.fixture
def broken_dirs(tiny_model_factory, tmp_path):
    """One directory per loader failure."""
    good = tiny_model_factory("qwen3")
    sharded = tiny_model_factory("qwen2", max_shard_size="40KB")
    dirs = {"missing": tmp_path / "nope", "file": tmp_path / "file.txt", "no_config": tmp_path / "empty"}
    dirs["file"].write_text("x")
    dirs["no_config"].mkdir()
    dirs["no_weights"] = tmp_path / "no_weights"
    dirs["no_weights"].mkdir()
    shutil.copy(good / "config.json", dirs["no_weights"])
    dirs["missing_shard"] = shutil.copytree(sharded, tmp_path / "missing_shard")
    shard = sorted(dirs["missing_shard"].glob("model-*.safetensors"))[-1]
    shard.unlink()
    dirs["missing_tensor"] = shutil.copytree(good, tmp_path / "missing_tensor")
    weights = load_file(dirs["missing_tensor"] / "model.safetensors")
    del weights["model.layers.1.self_attn.k_norm.weight"]
    save_file(weights, dirs["missing_tensor"] / "model.safetensors")
    dirs["gpt2"] = shutil.copytree(good, tmp_path / "gpt2")
    (dirs["gpt2"] / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 64, "n_layer": 2}))
    return dirs, shard.name


@pytest.mark.parametrize("kind, error, message", [
    ("missing", FileNotFoundError, "does not exist"),
    ("file", FileNotFoundError, "is a file"),
    ("no_config", FileNotFoundError, "no config.json"),
    ("no_weights", FileNotFoundError, "no safetensors weights"),
    ("missing_shard", FileNotFoundError, "is missing"),
    ("missing_tensor", ValueError, "model.layers.1.self_attn.k_norm.weight"),
    ("gpt2", ValueError, "unsupported model_type 'gpt2'"),
])
def test_loader_errors_name_the_path(broken_dirs, kind, error, message):
    dirs, shard_name = broken_dirs
    with pytest.raises(error, match=message) as info:
        load_model(dirs[kind])
    assert str(dirs[kind]) in str(info.value)
    if kind == "missing_shard":
        assert shard_name in str(info.value)


def test_tokenizer_round_trips_ascii_and_keeps_special_tokens_whole(tiny_model_factory):
    tok = build_tokenizer(("<reg_0>", "<reg_1>"))
    text = "Solve: 12 * (3+4) = ?\n\tAnswer:  84.  ~!@#$%^&{}|<>"
    ids = tok.encode(text)
    assert ids == list(text.encode("ascii"))  # byte b has id b, no merges
    assert tok.decode(ids) == text
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<reg_0>", "<reg_1>"]
    assert tok.encode("".join(specials)) == list(range(256, 263))
    assert tok.eos_token_id == tok.pad_token_id == 256
    loaded = load_tokenizer(tiny_model_factory("qwen3"))
    assert loaded.encode(text) == ids and loaded.decode(ids) == text
    assert loaded.eos_token_id == 256 and len(loaded) == 261
    generation = json.loads((tiny_model_factory("qwen3") / "generation_config.json").read_text())
    assert generation["eos_token_id"] == 256


def test_tiny_model_greedy_decoding_is_varied_and_tie_free(tiny_model_factory):
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_factory("qwen3"))
    prompt = torch.tensor([list(b"What is 2+2?")])
    out = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=128, min_new_tokens=128,
                      do_sample=False, output_scores=True, return_dict_in_generate=True)
    generated = out.sequences[0, prompt.shape[1]:].tolist()
    assert len(set(generated)) >= 8
    top2 = torch.stack(out.scores)[:, 0].topk(2, dim=-1).values
    assert (top2[:, 0] - top2[:, 1]).min() > 1e-3  # fp32 engines (error ~1e-5) pick the same argmax


def test_cli_writes_a_loadable_model(tmp_path):
    tiny_main([str(tmp_path / "m"), "--arch", "llama", "--untied", "--registers", "2"])
    model = load_model(tmp_path / "m")
    assert model.config.model_type == "llama" and model.config.vocab_size == 263
    assert isinstance(model, DecoderLM) and not model.config.tie_word_embeddings
