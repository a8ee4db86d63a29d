"""The Learner: gradients against Hugging Face transformers, windows, algorithms, bad input, checkpoints."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from sliderl.core.loader import load_model
from sliderl.core.trace import Trace
from sliderl.rollout import LLM, SamplingParams
from sliderl.trainer.algorithms import BoNBoNOptions, GRPOOptions, SFTOptions
from sliderl.trainer.learner import Learner
from sliderl.trainer.logprobs import trace_logprobs

P, W = 6, 8


def make_trace(seed: int, num_generated: int, *, spec: str = f"prefix_sliding:{W}", reward: float = 0.0,
               logprobs=None, forced=None, temperature: float = 0.8, components=None) -> Trace:
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, 256, (P,), generator=gen).tolist()
    completion = torch.randint(0, 256, (num_generated,), generator=gen).tolist()
    return Trace(f"t{seed}", "g", "p", 0, 0, spec, prompt, completion,
                 list(logprobs) if logprobs is not None else [-5.0] * num_generated, "length",
                 temperature=temperature, forced=list(forced or []), reward=reward,
                 reward_components=dict(components or {}))


def with_model_logprobs(path, trace: Trace) -> Trace:
    """The trace with the tiny model's own whole-trace logprobs as the sampler's (what the engine reports)."""
    with torch.no_grad():
        trace.logprobs = trace_logprobs(load_model(path), trace).tolist()
    return trace


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters()}


# ---- GRPO gradient = an independent HF computation over the loss tokens only ---------------------
def hf_window_logprobs(hf, trace: Trace, k: int):
    """HF forward over the truncated window's inputs (prompt + last k·W targets' predecessors) with a 4-D
    mask from DESIGN.md's prefix_sliding rule; returns (target logprobs [k·W], behaviour slice, target j's)."""
    t = len(trace.completion_token_ids)
    s = t - k * W
    positions = list(range(P)) + list(range(P + s - 1, P + t - 1))
    ids = (trace.prompt_token_ids + trace.completion_token_ids)
    q, kk = torch.tensor(positions)[:, None], torch.tensor(positions)[None, :]
    visible = (kk <= q) & ((kk < P) | (q - kk < W))
    mask = torch.zeros(visible.shape).masked_fill(~visible, -math.inf)[None, None]
    logits = hf(torch.tensor([[ids[p] for p in positions]]), attention_mask=mask,
                position_ids=torch.tensor([positions])).logits[0]
    targets = torch.tensor(ids[P + s:P + t])
    lp = torch.log_softmax(logits[P:] / trace.temperature, -1).gather(1, targets[:, None])[:, 0]
    return lp, torch.tensor(trace.logprobs[s:]), list(range(s, t))


def test_grpo_gradient_matches_hf_reference_and_ignores_non_loss_tokens(tiny_model_factory):
    path = tiny_model_factory(arch="qwen3")
    k, t = 2, 60
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    traces = [make_trace(1, t, reward=1.0), make_trace(2, t, reward=0.0, forced=[False] * 55 + [True] + [False] * 4)]
    gen = torch.Generator().manual_seed(3)
    for trace in traces:  # behaviour = HF's logprob -0.3..+0.3 on the loss tokens, so some ratios clip;
        lp, _, _ = hf_window_logprobs(hf, trace, k)  # garbage (-1000) elsewhere, which must never matter
        noise = (torch.rand(W, generator=gen) - 0.5) * 0.6
        trace.logprobs = [-1e3] * (t - W) + (lp[-W:].detach() + noise).tolist()
    learner = Learner(str(path), lr=1e-3, max_grad_norm=1e9, multiplier=k, micro_batch_tokens=1,
                      algo=GRPOOptions(clip_low=0.2, clip_high=0.28))
    metrics = learner.step([traces])
    # reference: advantages r - mean = [+0.5, -0.5]; loss tokens = last 8 targets, minus trace 2's forced
    # j = 55, so 8 + 7 = 15 tokens; loss = sum over them of -min(r·A, clip(r, 0.8, 1.28)·A) / 15
    total = 0.0
    for trace, adv in zip(traces, (0.5, -0.5)):
        lp, behaviour, js = hf_window_logprobs(hf, trace, k)
        on = torch.tensor([j >= t - W and not (trace.forced and trace.forced[j]) for j in js])
        ratio = torch.exp(lp[on] - behaviour[on])  # select first: the garbage would make inf·0 = NaN
        total = total - torch.minimum(ratio * adv, ratio.clamp(0.8, 1.28) * adv).sum()
    loss = total / 15
    loss.backward()
    assert metrics.num_loss_tokens == 15 and metrics.loss == pytest.approx(loss.item(), abs=1e-5)
    assert metrics.algorithm["clip_frac_low"] + metrics.algorithm["clip_frac_high"] > 0  # the test exercises clipping
    assert metrics.num_micro_batches == 2 and metrics.version == 1
    mine = grads(learner.model)
    for name, p in hf.named_parameters():
        assert torch.allclose(mine[name], p.grad, atol=1e-6, rtol=1e-4), name


def test_step_on_a_4000_token_trace_with_window_256(tiny_model_factory):
    """2 layers of prefix_sliding:256 look back 2·255 = 510 tokens; k=4 feeds 768 targets of context
    before the 256 loss tokens, so the truncated window rescored the sampler's logprobs exactly."""
    path = tiny_model_factory(arch="qwen3")
    traces = [with_model_logprobs(path, make_trace(i, 4000, spec="prefix_sliding:256", reward=float(i)))
              for i in (0, 1)]
    learner = Learner(str(path), lr=1e-3)
    before = learner.state_dict()
    m = learner.step([traces])
    assert m.num_tokens == 2 * (P + 1024) and m.num_loss_tokens == 2 * 256
    assert m.kl_mismatch < 1e-8 and m.logprob_diff_max < 1e-4
    assert m.stepped == 1 and learner.version == 1 and math.isfinite(m.loss) and m.grad_norm > 0
    after = learner.state_dict()
    assert any(not torch.equal(before[n], after[n]) for n in before)


@pytest.mark.gpu
def test_peak_memory_grows_with_the_trained_window_not_the_trace_on_cuda(tiny_model_factory):
    """Catches a peak that is not the step's own (never reset, or read before the backward): the learner's
    reported CUDA peak holds at least the fp32 weights, their gradients and AdamW's two moments (4 copies of
    the parameters, counted here), and a whole 4,000-token trace's step peaks above its truncated window's
    (P + 4·8 = 38 inputs) on the same model; CPU steps report None."""
    path = tiny_model_factory(arch="qwen3")
    traces = [make_trace(i, 4000, reward=float(i)) for i in (0, 1)]
    peaks = {}
    for mode in ("full", "truncated"):  # the larger first: a peak never reset would carry over
        learner = Learner(str(path), lr=1e-3, device="cuda", window_mode=mode)
        params = sum(p.numel() for p in learner.model.parameters()) * 4 / 2**30
        learner.step([traces])  # AdamW's moments exist from the first step on
        peaks[mode] = learner.step([traces]).peak_memory_gib
        assert peaks[mode] >= 4 * params, (mode, peaks[mode], params)
        del learner
        torch.cuda.empty_cache()
    assert peaks["full"] > peaks["truncated"]
    assert Learner(str(path), lr=1e-3).step([traces]).peak_memory_gib is None


def test_chunked_accumulation_equals_full_backprop_when_context_covers_the_receptive_field(tiny_model_factory):
    """Chunks of W = 8 loss tokens with 24 tokens of context see everything 2 layers of window 8 can reach,
    so summing the chunks' gradients gives the whole-trace gradient (seq_mean_token_mean weights per trace)."""
    path = tiny_model_factory(arch="qwen3")
    traces = [with_model_logprobs(path, make_trace(i, 70 + 9 * i, reward=float(i))) for i in (0, 1)]  # 9, 10 chunks
    grpo = GRPOOptions(aggregation="seq_mean_token_mean")
    chunked = Learner(str(path), window_mode="chunked", micro_batch_tokens=40, max_grad_norm=1e9, algo=grpo)
    full = Learner(str(path), window_mode="full", max_grad_norm=1e9, algo=grpo)
    checkpointed = Learner(str(path), window_mode="full", max_grad_norm=1e9, algo=grpo, gradient_checkpointing=True)
    mc, mf = chunked.step([traces]), full.step([traces])
    checkpointed.step([traces])
    assert mc.num_windows == 9 + 10 and mc.num_micro_batches > 5 and mf.num_windows == 2
    assert mc.num_loss_tokens == mf.num_loss_tokens == 70 + 79
    assert mc.loss == pytest.approx(mf.loss, abs=1e-6)
    gc, gf, gk = grads(chunked.model), grads(full.model), grads(checkpointed.model)
    for name in gf:
        assert torch.allclose(gc[name], gf[name], atol=1e-6, rtol=1e-4), name
        assert torch.allclose(gk[name], gf[name], atol=1e-7), name  # recomputing layers in backward changes nothing


# ---- algorithms -----------------------------------------------------------------------------------
def test_bonbon_pairs_best_and_worst_and_starts_at_zero_margin(tiny_model_factory):
    path = tiny_model_factory(arch="qwen3")
    # score = speedup + λ·correctness, λ = 2: [1 + 2, 2 + 0, 1.5 + 2] = [3, 2, 3.5] -> chosen 2, rejected 1
    parts = [dict(speedup=1.0, correctness=1.0), dict(speedup=2.0, correctness=0.0), dict(speedup=1.5, correctness=1.0)]
    group = [make_trace(i, 30, components=c) for i, c in enumerate(parts)]
    tie = [make_trace(10 + i, 30, components=dict(speedup=1.0, correctness=1.0)) for i in range(2)]
    learner = Learner(str(path), algo=BoNBoNOptions(quality_weight=2.0, beta=0.1, alpha=0.5), lr=1e-2)
    selection = learner.algorithm.select([group, tie])
    assert [t.trace_id for t in selection.traces] == ["t2", "t1"] and selection.roles == ["chosen", "rejected"]
    assert selection.metrics["no_pair_groups"] == 1
    m1 = learner.step([group, tie])
    # the policy starts equal to the frozen reference: h = 0, IPO = (0 - 1/(2·0.1))² = 25
    assert m1.algorithm["ipo/margin_mean"] == 0.0 and m1.algorithm["ipo/loss"] == pytest.approx(25.0)
    assert m1.loss == pytest.approx(0.5 * m1.algorithm["sft/loss"] + 0.5 * 25.0, rel=1e-6)
    m2 = learner.step([group])
    assert m2.algorithm["ipo/margin_mean"] != 0.0  # the reference stayed frozen while the policy moved


def test_sft_loss_is_the_token_mean_nll_over_non_forced_tokens(tiny_model_factory):
    path = tiny_model_factory(arch="qwen3")
    traces = [make_trace(1, 12, spec="full", temperature=1.0, forced=[False] * 11 + [True]),
              make_trace(2, 5, spec="full", temperature=1.0)]
    learner = Learner(str(path), algo=SFTOptions(), lr=0.0)
    m = learner.step([traces])
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    nll = []
    for trace in traces:
        ids = torch.tensor([trace.prompt_token_ids + trace.completion_token_ids])
        with torch.no_grad():
            logp = torch.log_softmax(hf(ids).logits[0, P - 1:-1], -1)
        picked = logp.gather(1, torch.tensor(trace.completion_token_ids)[:, None])[:, 0]
        nll += [-x for x, f in zip(picked.tolist(), trace.forced or [False] * 5) if not f]
    assert m.num_loss_tokens == 11 + 5
    assert m.loss == pytest.approx(sum(nll) / 16, abs=1e-5)


def test_grpo_against_recomputed_logprobs_with_tis_and_reference_kl(tiny_model_factory):
    path = tiny_model_factory(arch="qwen3")
    traces = [make_trace(i, 30, reward=float(i)) for i in (0, 1)]  # sampler logprobs -5.0 everywhere
    learner = Learner(str(path), lr=1e-2, algo=GRPOOptions(old_logprobs="recomputed", tis_cap=2.0, kl_coef=0.1))
    m = learner.step([traces])
    # old = the trainer's own detached logprobs: every ratio is exactly 1, nothing clips; the policy
    # equals the frozen reference at the first step, so k3 KL is 0; the sampler's -5.0 only feeds TIS
    assert m.algorithm["ratio_mean"] == 1.0 and m.algorithm["clip_frac_low"] == m.algorithm["clip_frac_high"] == 0.0 and m.algorithm["kl"] == 0.0
    assert 0 < m.algorithm["tis_weight_mean"] <= 2.0 and m.algorithm["mismatch_kl"] > 0
    assert learner.step([traces]).algorithm["kl"] > 0  # the policy moved away from the reference


# ---- bad input ------------------------------------------------------------------------------------
def test_bad_input_raises_or_is_counted_never_nan(tiny_model_factory):
    path = tiny_model_factory(arch="qwen3")
    learner = Learner(str(path), lr=1e-3)
    good = [make_trace(1, 20, reward=1.0), make_trace(2, 20, reward=0.0)]
    with pytest.raises(ValueError, match=r"trace 't9'.*unknown KV policy 'lru'"):
        learner.step([[make_trace(9, 20, spec="lru:4", reward=1.0), make_trace(8, 20)]])
    with pytest.raises(ValueError, match="non-finite sampler logprobs"):
        learner.step([[make_trace(7, 5, logprobs=[0.0, math.nan, 0, 0, 0], reward=1.0), make_trace(6, 5)]])
    with pytest.raises(ValueError, match="3 sampler logprobs for 5 completion tokens"):
        learner.step([[make_trace(5, 5, logprobs=[0.0] * 3, reward=1.0), make_trace(4, 5)]])
    assert learner.version == 0
    nan_group = [make_trace(3, 20, reward=math.nan), make_trace(4, 20, reward=1.0)]
    flat = [make_trace(5, 20, reward=1.0), make_trace(6, 20, reward=1.0)]
    all_forced = [make_trace(7, 4, reward=1.0, forced=[True] * 4), make_trace(8, 4, reward=0.0, forced=[True] * 4)]
    m = learner.step([nan_group, flat, all_forced])  # nothing to train on: counted, not stepped
    assert m.algorithm["skipped_groups_nonfinite_reward"] == 1 and m.algorithm["zero_variance_groups"] == 1
    assert m.skipped_traces_no_loss == 2 and m.stepped == 0 and m.loss == 0.0
    assert learner.version == 0
    m = learner.step([nan_group, good])
    assert m.stepped == 1 and m.algorithm["skipped_groups_nonfinite_reward"] == 1 and math.isfinite(m.loss)
    with pytest.raises(ValueError, match="type must be one of grpo, bonbon, sft, planned_diffusion, got 'ppo'"):
        Learner(str(path), algo=dict(type="ppo"))
    with pytest.raises(ValueError, match="got 'chunked'"):
        Learner(str(path), algo=BoNBoNOptions(), window_mode="chunked")
    with pytest.raises(ValueError, match=r"unknown grpo option\(s\) \['clip'\]"):
        Learner(str(path), algo=dict(type="grpo", clip=0.2))
    bonbon = Learner(str(path), algo=BoNBoNOptions())
    with pytest.raises(ValueError, match=r"no reward component\(s\) \['speedup'\]"):
        bonbon.step([[make_trace(1, 5, components=dict(correctness=1.0)), make_trace(2, 5)]])



def test_a_non_finite_loss_or_gradient_raises_and_leaves_the_weights_untouched(tiny_model_factory):
    # Catches: an optimizer step taken on NaN/inf gradients (weights silently destroyed, version
    # bumped), or gradients of the failed step left in .grad to leak into the next one. Both faults
    # are injected for real: a weight set to NaN (a corrupted model: the loss is NaN), and a tensor
    # hook that makes one parameter's gradient infinite (the loss stays finite). Planted by removing
    # the isfinite check in Learner._clip_and_step, the optimizer steps and the weights change.
    path = tiny_model_factory(arch="qwen3")
    learner = Learner(str(path), lr=1e-2)
    group = [make_trace(1, 20, reward=1.0), make_trace(2, 20, reward=0.0)]
    before = {n: p.detach().clone() for n, p in learner.model.named_parameters()}
    param = dict(learner.model.named_parameters())["model.layers.0.mlp.down_proj.weight"]
    hook = param.register_hook(lambda g: torch.full_like(g, math.inf))
    with pytest.raises(FloatingPointError, match="gradient norm is (inf|nan); the step was not taken"):
        learner.step([group])
    hook.remove()
    assert learner.version == 0 and all(p.grad is None for p in learner.model.parameters())
    assert all(torch.equal(p, before[n]) for n, p in learner.model.named_parameters())
    with torch.no_grad():
        param[0, 0] = math.nan
    with pytest.raises(FloatingPointError, match=r"non-finite loss nan in a micro-batch of \d+ windows"):
        learner.step([group])
    assert learner.version == 0 and all(p.grad is None for p in learner.model.parameters())
    with torch.no_grad():
        param[0, 0] = before["model.layers.0.mlp.down_proj.weight"][0, 0]
    assert learner.step([group]).stepped == 1 and learner.version == 1  # the learner is usable again

# ---- weights and checkpoints ----------------------------------------------------------------------
def test_checkpoint_round_trip_resumes_exactly_and_loads_elsewhere(tiny_model_factory, tmp_path):
    path = tiny_model_factory(arch="qwen3")  # its tokenizer has no <reg_i>: the learner adds two
    groups = [[make_trace(i, 20, spec="registers:2", reward=float(i)) for i in (0, 1)]]
    learner = Learner(str(path), lr=1e-2, vocab_policy="registers:2", seed=3)
    learner.step(groups)
    ckpt = tmp_path / "ckpt"
    learner.save_checkpoint(ckpt)
    saved = learner.state_dict()
    rng_after_save = torch.rand(3)
    resumed = Learner.from_checkpoint(ckpt)
    assert torch.equal(torch.rand(3), rng_after_save)  # RNG state restored
    assert resumed.version == 1 and resumed.args == learner.args
    b = resumed.state_dict()
    assert saved.keys() == b.keys() and all(torch.equal(saved[n], b[n]) for n in saved)
    sa, sb = learner.optimizer.state_dict()["state"], resumed.optimizer.state_dict()["state"]
    assert sa.keys() == sb.keys() and all(torch.equal(sa[i]["exp_avg_sq"], sb[i]["exp_avg_sq"]) for i in sa)
    learner.step(groups)
    resumed.step(groups)
    a, b = learner.state_dict(), resumed.state_dict()
    assert all(torch.equal(a[n], b[n]) for n in a)  # the next step is identical
    # the saved directory is a Hugging Face model with the grown vocabulary and the register tokens
    hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    assert hf.config.vocab_size == learner.model.config.vocab_size == 263
    hf_weights = {n: p.detach() for n, p in hf.named_parameters()}
    assert hf_weights.keys() == saved.keys() and all(torch.equal(hf_weights[n], saved[n]) for n in saved)
    llm = LLM(str(ckpt), kv="registers:2", block_size=4, num_blocks=64)
    assert llm.policy.register_ids == learner.vocab_policy.register_ids
    assert torch.equal(llm.model.model.embed_tokens.weight, saved["model.embed_tokens.weight"])
    assert len(llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0.0))[0].token_ids) == 4


def test_a_resumed_learner_keeps_checkpointing_after_its_checkpoint_is_pruned(tiny_model_factory, tmp_path):
    # Catches (issue 11, bug 1): a learner resumed from checkpoint A read A's config again whenever it
    # saved, so once pruning deleted A ("keep" saves later) every save failed; and BoNBoN's reference
    # defaulting to the folder the learner was loaded from (A) instead of the initial model. Planted
    # by saving from self.model_path again, the second save raises.
    import shutil

    path = tiny_model_factory(arch="qwen3")
    groups = [[make_trace(i, 12, reward=float(i), components={"speedup": float(i), "correctness": 1.0})
               for i in (0, 1)]]
    learner = Learner(str(path), lr=1e-2, algo=BoNBoNOptions())
    assert learner.args.reference_model_path == str(path)
    learner.step(groups)
    first = tmp_path / "step_000001"
    learner.save_checkpoint(first)
    resumed = Learner.from_checkpoint(first)
    assert resumed.args.reference_model_path == str(path)  # still the initial model, not the checkpoint
    shutil.rmtree(first)  # what Checkpoints.prune does `keep` saves later
    resumed.step(groups)
    second = tmp_path / "step_000002"
    resumed.save_checkpoint(second)
    again = Learner.from_checkpoint(second)
    assert again.version == 2 and (second / "config.json").is_file()


class _RunsCode:
    """Unpickling this runs ``open(path, "w")``: what a crafted trainer_state.pt could do with os.system."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_a_crafted_trainer_state_is_refused_without_running_code(tiny_model_factory, tmp_path):
    # Catches: loading trainer_state.pt with a full unpickler (torch.load(weights_only=False)), which
    # runs whatever callable the file names -- here it would create a file; the loader must refuse
    # the file with a clear error instead. Checked by planting weights_only=False: the file appears
    # and no error is raised.
    path = tiny_model_factory(arch="qwen3")
    learner = Learner(str(path), lr=1e-2)
    ckpt = tmp_path / "ckpt"
    learner.save_checkpoint(ckpt)
    state = torch.load(ckpt / "trainer_state.pt", weights_only=True)  # what sliderl writes loads safely
    assert {"version", "optimizer", "rng", "args"} <= set(state)
    marker = tmp_path / "pwned"
    torch.save({**state, "args": _RunsCode(str(marker))}, ckpt / "trainer_state.pt")
    with pytest.raises(ValueError, match="trainer_state.pt (has|does not match)"):  # the manifest sees the change
        Learner.from_checkpoint(ckpt)
    (ckpt / "manifest.json").unlink()  # whoever crafts the file controls the folder: the loader must refuse it too
    with pytest.raises(ValueError, match="holds objects other than tensors and plain values"):
        Learner.from_checkpoint(ckpt)
    assert not marker.exists()


# ---- settings: the lr schedule, option records, the trace's own policy -----------------------------
def test_lr_schedule_warms_up_then_follows_the_cosine_and_resumes_from_a_checkpoint(tiny_model_factory, tmp_path):
    # catches: an off-by-one in the warm-up or cosine, a schedule that is not applied to the optimizer,
    # or one that restarts after from_checkpoint
    from sliderl.trainer.learner_args import LearnerArgs

    args = LearnerArgs(algo=SFTOptions(), lr=0.1, lr_schedule="cosine", warmup_steps=2, total_steps=6,
                       min_lr_ratio=0.2)
    # step s < 2: 0.1·(s+1)/2 = 0.05, 0.1; then p = (s-2)/4 and lr = 0.1·(0.2 + 0.8·(1 + cos(pi·p))/2):
    # s=2: p=0 -> 0.1; s=3: p=1/4 -> 0.1·(0.2 + 0.4·1.70711) = 0.0882843; s=4: p=1/2 -> 0.1·0.6 = 0.06;
    # s=5: p=3/4 -> 0.1·(0.2 + 0.4·0.29289) = 0.0317157; s=6: p=1 -> 0.02; s=7: held at 0.02
    expected = [0.05, 0.1, 0.1, 0.0882843, 0.06, 0.0317157, 0.02, 0.02]
    assert [args.lr_at(s) for s in range(8)] == pytest.approx(expected, abs=1e-7)
    assert LearnerArgs(lr=0.1, warmup_steps=4).lr_at(1) == pytest.approx(0.05)  # 0.1·2/4
    assert LearnerArgs(lr=0.1, warmup_steps=4).lr_at(9) == 0.1  # constant after the warm-up
    path = tiny_model_factory(arch="qwen3")
    traces = [make_trace(i, 6, spec="full", logprobs=[]) for i in (1, 2)]
    learner = Learner(str(path), args)
    seen = []
    for _ in range(4):
        m = learner.step([traces])
        seen.append((m.lr, learner.optimizer.param_groups[0]["lr"]))
    learner.save_checkpoint(tmp_path / "ckpt")
    resumed = Learner.from_checkpoint(tmp_path / "ckpt")
    assert resumed.args == args
    seen += [(resumed.step([traces]).lr, resumed.optimizer.param_groups[0]["lr"]) for _ in range(4)]
    assert [a for a, _ in seen] == pytest.approx(expected, abs=1e-7)
    assert [b for _, b in seen] == pytest.approx(expected, abs=1e-7)  # what AdamW actually used


def test_each_trace_is_trained_under_its_own_policy_whatever_the_vocab_policy(tiny_model_factory):
    # catches: masks taken from the learner's vocab_policy instead of trace.kv_policy (the old override)
    path = tiny_model_factory(arch="qwen3")
    # 60 generated tokens under prefix_sliding:8, scored by the sampler under that policy; a sliding_window:3
    # or full mask would see other keys and move the recomputed logprobs far from the sampler's
    traces = [with_model_logprobs(path, make_trace(i, 60, reward=float(i))) for i in (0, 1)]
    for vocab_policy in (None, "sliding_window:3", "full"):
        learner = Learner(str(path), window_mode="full", vocab_policy=vocab_policy)
        m = learner.step([traces])
        assert m.kl_mismatch < 1e-8 and m.logprob_diff_max < 1e-4, vocab_policy


def test_option_records_reject_unknown_and_ill_formed_options_with_a_clear_message():
    # catches: options accepted without their bounds checked, or a typo passing silently
    from pydantic import TypeAdapter, ValidationError

    from sliderl.trainer.algorithms import BoNBoNOptions, options_from_dict
    from sliderl.trainer.learner_args import LearnerArgs

    with pytest.raises(ValueError, match="clip_low must be >= 0, got -0.1"):
        GRPOOptions(clip_low=-0.1)
    with pytest.raises(ValueError, match="aggregation must be one of token_mean, seq_mean_token_mean, constant"):
        GRPOOptions(aggregation="mean")
    with pytest.raises(ValueError, match="constant_norm must be > 0 with aggregation='constant'"):
        GRPOOptions(aggregation="constant")
    with pytest.raises(ValueError, match="tis_cap must be None unless old_logprobs='recomputed'"):
        GRPOOptions(tis_cap=2.0)
    with pytest.raises(ValueError, match=r"alpha must be in \[0, 1\], got 1.5"):
        BoNBoNOptions(alpha=1.5)
    with pytest.raises(ValueError, match=r"unknown bonbon option\(s\) \['gamma'\]; valid: \['alpha', 'beta'"):
        options_from_dict(dict(type="bonbon", gamma=1.0))
    with pytest.raises(ValueError, match="total_steps must be > 0 with lr_schedule 'cosine'"):
        LearnerArgs(lr_schedule="cosine")
    with pytest.raises(ValueError, match=r"adam_betas must be two numbers in \[0, 1\), got \(0.9, 1.0\)"):
        LearnerArgs(adam_betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="device must be cpu, cuda or cuda:N, got 'gpu'"):
        LearnerArgs(device="gpu")
    # the job config validates the records directly: extra keys rejected, __post_init__ errors surfaced
    adapter = TypeAdapter(LearnerArgs)
    assert adapter.validate_python({"algo": {"type": "bonbon", "alpha": 0.1}, "lr": 1e-3}).algo == BoNBoNOptions(alpha=0.1)
    with pytest.raises(ValidationError, match="clip"):
        adapter.validate_python({"algo": {"type": "grpo", "clip": 0.2}})
    with pytest.raises(ValidationError, match="kl_coef must be >= 0"):
        adapter.validate_python({"algo": {"type": "grpo", "kl_coef": -1}})
    schema = json.dumps(adapter.json_schema())
    assert "Peak AdamW learning rate" in schema and "Lower PPO clip" in schema  # field docstrings are the help


def test_sft_accepts_traces_without_sampler_logprobs_and_grpo_rejects_them(tiny_model_factory):
    # catches: SFT data (no sampler logprobs) refused by SFT, or silently accepted by GRPO (its ratio needs them)
    path = tiny_model_factory(arch="qwen3")
    traces = [make_trace(i, 10, spec="full", reward=float(i), logprobs=[]) for i in (0, 1)]
    m = Learner(str(path), algo=SFTOptions(), lr=1e-3).step([traces])
    assert m.stepped and m.num_loss_tokens == 20 and math.isfinite(m.loss)
    assert m.kl_mismatch is None and m.kl_mismatch_k1 is None and m.logprob_diff_max is None
    assert "kl_mismatch" not in m.as_dict() and m.as_dict()["stepped"] == 1.0
    with pytest.raises(ValueError, match=r"trace 't0' has 0 sampler logprobs for 10 completion tokens \(grpo needs"):
        Learner(str(path)).step([traces])


def test_a_registers_trace_after_step_one_needs_the_vocab_policy(tiny_model_factory):
    # catches: the vocabulary grown (and the optimizer reset) after training started
    path = tiny_model_factory(arch="qwen3")
    learner = Learner(str(path), lr=1e-3)
    learner.step([[make_trace(i, 20, reward=float(i)) for i in (0, 1)]])
    with pytest.raises(ValueError, match=r"trace 't2'.*vocab_policy='registers:2'"):
        learner.step([[make_trace(i, 20, spec="registers:2", reward=float(i)) for i in (2, 3)]])
