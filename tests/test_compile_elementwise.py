"""DecoderLM.compile_elementwise (the learner's ``compile_elementwise``): the norms with their residual adds,
q/k-norm + RoPE and SiLU·mul as torch.compile'd graphs give transformers' own loss and gradients.

On the CPU the graphs compile with the ``aot_eager`` backend (AOTAutograd's forward/backward split, no C++
compiler needed, as CI has none); the GPU test compiles them with inductor, the learner's backend on CUDA."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import sliderl.core.model as model_module
from sliderl.core.loader import load_model
from sliderl.core.model import DenseAttention, causal_mask

VOCAB = 256


def loss_and_grads(model, ids, targets, checkpointing: bool):
    """Our model's summed target log-probability over a packed stream of two documents, and its gradients."""
    model.train()
    model.gradient_checkpointing = checkpointing
    positions = torch.cat([torch.arange(20), torch.arange(ids.numel() - 20)]).to(ids.device)
    mask = torch.block_diag(causal_mask(20), causal_mask(ids.numel() - 20)).to(ids.device)
    model.zero_grad()
    logits = model.compute_logits(model(ids, positions, DenseAttention(mask)))
    loss = torch.log_softmax(logits, -1).gather(1, targets[:, None]).sum()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def hf_loss_and_grads(hf, ids, targets):
    """transformers' forward of each document on its own, the same loss, its gradients by our names."""
    hf.zero_grad()
    loss = 0.0
    for part, tgt in ((ids[:20], targets[:20]), (ids[20:], targets[20:])):
        logits = hf(part[None], attention_mask=torch.ones(1, part.numel(), dtype=torch.long)).logits[0].float()
        loss = loss + torch.log_softmax(logits, -1).gather(1, tgt[:, None]).sum()
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in hf.named_parameters() if p.grad is not None}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("arch", ["qwen3", "llama"])  # qwen3 has q/k-norm, llama has none
@pytest.mark.parametrize("checkpointing", [False, True])
def test_compiled_elementwise_chains_give_transformers_loss_and_gradients(tiny_model_factory, monkeypatch, arch,
                                                                          checkpointing):
    # Catches a compiled chain that computes other math than the eager layer: the residual add dropped or
    # applied twice, RoPE's cos and sin swapped, the q/k-norm weights crossed or skipped, the norm's epsilon
    # lost, SiLU applied to the up projection; and the flag not reaching the layers under gradient checkpointing
    # (then the cache of compiled graphs stays empty). Checked by planting: swapping cos and sin in
    # qk_norm_rope_math's apply_rope calls, or returning ``x`` instead of the sum from add_rms_norm_math, fails
    # every case; passing compiled=False through checkpoint fails the cache assertion.
    monkeypatch.setattr(model_module, "COMPILE_BACKEND", "aot_eager")
    model_module._compiled.cache_clear()
    torch._dynamo.reset()
    path = tiny_model_factory(arch)
    model, hf = load_model(path), AutoModelForCausalLM.from_pretrained(path)
    gen = torch.Generator().manual_seed(3)
    ids, targets = torch.randint(0, VOCAB, (52,), generator=gen), torch.randint(0, VOCAB, (52,), generator=gen)
    model.compile_elementwise = True
    loss, grads = loss_and_grads(model, ids, targets, checkpointing)
    compiled = model_module._compiled.cache_info().currsize
    assert compiled == 4  # rms_norm, add + rms_norm, qk_norm_rope (weights None for llama), silu_mul
    hf_loss, hf_grads = hf_loss_and_grads(hf, ids, targets)
    assert abs(loss.item() - hf_loss.item()) <= 1e-3 * abs(hf_loss.item())
    assert set(grads) == set(hf_grads)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, hf_grads[name], rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.gpu
@pytest.mark.timeout(600)
def test_inductor_compiled_chains_match_eager_on_cuda_in_bf16(tiny_model_factory):
    # Catches an inductor-fused kernel whose numbers part from the eager ops by more than bf16 rounding (the
    # float32 norm computed in bf16, a cast dropped), on the backend the learner uses on the GPU.
    model_module._compiled.cache_clear()
    torch._dynamo.reset()
    path = tiny_model_factory("qwen3", hidden_size=256, num_heads=4, num_kv_heads=2, intermediate_size=512)
    gen = torch.Generator().manual_seed(4)
    ids, targets = torch.randint(0, VOCAB, (300,), generator=gen), torch.randint(0, VOCAB, (300,), generator=gen)
    out = {}
    for compiled in (False, True):
        model = load_model(path, dtype=torch.bfloat16, device="cuda")
        model.compile_elementwise = compiled
        loss, grads = loss_and_grads(model, ids.cuda(), targets.cuda(), checkpointing=True)
        out[compiled] = (loss, grads)
    assert model_module._compiled.cache_info().currsize == 4
    (eager_loss, eager), (comp_loss, comp) = out[False], out[True]
    assert abs(comp_loss.item() - eager_loss.item()) <= 2e-2 * abs(eager_loss.item())
    for name, grad in eager.items():
        cos = torch.nn.functional.cosine_similarity(grad.float().flatten(), comp[name].float().flatten(), dim=0)
        assert cos > 0.99, (name, cos.item())


@pytest.mark.timeout(300)
def test_the_learner_setting_reaches_the_trained_model_and_the_reference(tiny_model_factory, monkeypatch):
    # Catches learner.compile_elementwise parsed but never set on the models the learner runs (the step would
    # then be eager and the GPU rows would measure nothing new): after one GRPO step with a KL term (so the
    # frozen reference runs too) the compiled graphs exist, and the step's loss is the eager learner's.
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from learner_ranks import policies_batch

    from sliderl.trainer.algorithms import GRPOOptions
    from sliderl.trainer.learner import Learner

    monkeypatch.setattr(model_module, "COMPILE_BACKEND", "aot_eager")
    path = str(tiny_model_factory("qwen3"))
    losses = {}
    for compiled in (False, True):
        model_module._compiled.cache_clear()
        torch._dynamo.reset()
        learner = Learner(path, algo=GRPOOptions(kl_coef=0.1), lr=1e-4, window=8, multiplier=2,
                          micro_batch_tokens=64, compile_elementwise=compiled, vocab_policy="registers:3")
        assert learner.model.compile_elementwise == compiled and learner.reference.compile_elementwise == compiled
        losses[compiled] = learner.step(policies_batch(path, 1)).loss
        # the four chains and the LM head's logprob (trainer.logprobs.head_logprobs)
        assert (model_module._compiled.cache_info().currsize == 5) == compiled
    assert losses[True] == pytest.approx(losses[False], rel=1e-5)


@pytest.mark.timeout(300)
def test_the_compiled_lm_head_gives_the_eager_logprobs_and_gradients(tiny_model_factory, monkeypatch):
    # Catches a compiled head (trainer.logprobs.head_logprobs) that scores other than the eager chunks: the
    # temperature dropped or applied to greedy rows (T = 0 must score unscaled; planted, temperature passed as
    # ones: the T = 0.7 rows differ), the target's logit taken at another id, or a chunk's gradient lost under
    # the chunks' checkpointing (chunk_rows 7 splits the 30 targets into five chunks, the last one short).
    from sliderl.core.kv_policy import KVPolicy
    from sliderl.trainer.logprobs import pack_windows, packed_logprobs, window_input

    monkeypatch.setattr(model_module, "COMPILE_BACKEND", "aot_eager")
    model_module._compiled.cache_clear()
    torch._dynamo.reset()
    model = load_model(tiny_model_factory("qwen3")).train()
    gen = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, VOCAB, (6,), generator=gen).tolist()
    completion = torch.randint(0, VOCAB, (15,), generator=gen).tolist()
    policy = KVPolicy.parse("prefix_sliding:8")
    packed = pack_windows([window_input(prompt, completion, policy, t) for t in (0.7, 0.0)])
    out = {}
    for compiled in (False, True):
        model.compile_elementwise = compiled
        model.zero_grad()
        logprobs = packed_logprobs(model, packed, "sdpa", chunk_rows=7)
        (logprobs * torch.linspace(0.5, 1.5, logprobs.numel())).sum().backward()
        out[compiled] = logprobs.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}
    assert model_module._compiled.cache_info().currsize == 5
    (eager, eager_grads), (comp, comp_grads) = out[False], out[True]
    assert comp.shape == (30,) and (eager[:15] - eager[15:]).abs().max() > 1e-3  # T = 0.7 and T = 0 differ
    torch.testing.assert_close(comp, eager, rtol=1e-5, atol=1e-6)
    for name, grad in eager_grads.items():
        torch.testing.assert_close(comp_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_auto_compiles_on_cuda_learners_only_and_the_config_parses_each_setting():
    # Catches learner.compile_elementwise: auto resolved the wrong way round — a CPU learner compiling (inductor
    # needs a C++ compiler, which CI's machine lacks: the default job would fail at its first step) or a GPU
    # learner left eager (the truncated 32K step 1.57x slower on an H100, docs/results.md "Learner") — and an
    # explicit true/false from the command line read as anything but a bool.
    from sliderl.cluster.config.base import load_config
    from sliderl.cluster.config.train import TrainConfig
    from sliderl.trainer.learner_args import compiles_elementwise

    assert compiles_elementwise("auto", torch.device("cuda", 0)) is True
    assert compiles_elementwise("auto", torch.device("cpu")) is False
    assert compiles_elementwise(True, torch.device("cpu")) is True
    assert compiles_elementwise(False, torch.device("cuda")) is False
    assert load_config(TrainConfig, None).learner.compile_elementwise == "auto"
    for text, value in (("true", True), ("false", False), ("auto", "auto")):
        got = load_config(TrainConfig, None, [f"learner.compile_elementwise={text}"]).learner.compile_elementwise
        assert got is value or got == value and type(got) is type(value), (text, got)
