"""SFT stages (trainer.sft): Learner + SFT on (prompt, completion) pairs — the loss falls, the held-out
exact match is greedy decoding's, the checkpoint loads in the engine and in transformers, the cache works."""

import dataclasses
import json

import pytest
import torch

from sliderl.core.loader import load_model
from sliderl.core.model import DenseAttention, causal_mask
from sliderl.core.tiny import build_tokenizer
from sliderl.rollout import LLM, SamplingParams
from sliderl.tasks.arith import ArithTask
from sliderl.trainer.algorithms import GRPOOptions, SFTOptions
from sliderl.trainer.learner_args import LearnerArgs
from sliderl.trainer.sft import MARKER, SFTArgs, SFTExample, cached_sft, run_sft, sft_trace

TASK = ArithTask(num_steps=(3, 4), max_operand=5, max_value=20)
KV = "prefix_sliding:8"
TINY = dict(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64)
ARGS = LearnerArgs(algo=SFTOptions(), lr=1e-2, weight_decay=0.01, adam_betas=(0.9, 0.98), lr_schedule="cosine",
                   warmup_steps=3, total_steps=30, window_mode="full")
SFT = SFTArgs(steps=30, batch_size=8)


def examples(n: int, split: str = "train") -> list[SFTExample]:
    return [SFTExample(p["prompt"], p["solution"]) for p in TASK.problems(n, split)]


@pytest.fixture(scope="module")
def base_model(tmp_path_factory):
    from sliderl.core.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("sft-init") / "init", **TINY)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, base_model):
    return cached_sft(tmp_path_factory.mktemp("sft-cache"), base_model, examples(240), examples(32, "eval"),
                      KV, ARGS, SFT)


def test_sft_lowers_the_loss_and_exact_match_is_greedy_decoding_under_the_policy(base_model, checkpoint):
    # catches: evaluate scoring other tokens than the completion + eos, or under another mask than the
    # trace's policy (the engine's greedy decoding under that policy is the independent reference)
    from sliderl.trainer.learner import Learner

    assert checkpoint.steps_run == 30 and len(checkpoint.losses) == 30
    # a random model starts near ln(vocab) = ln(259) = 5.6 nats per token; 30 steps learn the format
    assert checkpoint.losses[0] > 4.0 and sum(checkpoint.losses[-5:]) / 5 < 0.5 * checkpoint.losses[0]
    held_out = examples(32, "eval")
    before = Learner(str(base_model), ARGS)
    after = Learner(checkpoint.path, ARGS)
    traces = [sft_trace(after.tokenizer, e, KV, i) for i, e in enumerate(held_out)]
    start, end = before.evaluate([traces]), after.evaluate([traces])
    assert end.loss < 0.6 * start.loss and end.num_traces == 32
    # the engine's greedy continuations under KV (eos included when it stopped): as the completion of every
    # other trace they reproduce greedy decoding by construction; the reference solutions do only where
    # the engine's output equals them
    llm = LLM(checkpoint.path, kv=KV)
    outs = llm.generate([t.prompt_token_ids for t in traces], SamplingParams(max_tokens=64, temperature=0.0))
    for t, o in zip(traces[::2], outs[::2]):
        t.completion_token_ids = list(o.token_ids)
    greedy = [o.token_ids == t.completion_token_ids for o, t in zip(outs, traces)]
    assert 16 <= sum(greedy) < 32  # all engine continuations, and not every reference
    per_trace = [after.evaluate([[t]]).exact_match for t in traces]
    assert per_trace == [float(g) for g in greedy]
    assert after.evaluate([traces]).exact_match == pytest.approx(sum(greedy) / len(greedy))
    assert 0 < end.token_accuracy < 1


def test_sft_traces_are_prompt_then_completion_and_eos_without_logprobs():
    tokenizer = build_tokenizer()
    trace = sft_trace(tokenizer, SFTExample("ab\n", "xyz"), "prefix_sliding:2", 7)
    assert trace.prompt_token_ids == [ord("a"), ord("b"), ord("\n")]
    assert trace.completion_token_ids == [ord("x"), ord("y"), ord("z"), tokenizer.eos_token_id]
    assert trace.logprobs == [] and trace.kv_policy == "prefix_sliding:2"


def test_checkpoint_matches_transformers_and_runs_in_the_engine(checkpoint, base_model):
    from transformers import AutoModelForCausalLM

    problem = TASK.problems(1, "eval")[0]
    tokenizer = build_tokenizer()
    ids = tokenizer(problem["prompt"] + problem["solution"]).input_ids
    hf = AutoModelForCausalLM.from_pretrained(checkpoint.path, local_files_only=True).eval()
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0].float()
        ours = load_model(checkpoint.path)
        n = len(ids)
        got = ours.compute_logits(ours(torch.tensor(ids), torch.arange(n), DenseAttention(causal_mask(n))))
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    # the trained weights are what was saved: not the random initialisation any more
    assert not torch.allclose(hf.model.embed_tokens.weight, load_model(base_model).model.embed_tokens.weight)

    # the engine loads the same weights: its greedy tokens and logprobs are transformers' (full attention)
    prompt = tokenizer(problem["prompt"]).input_ids
    out = LLM(checkpoint.path, kv="full").generate([prompt], SamplingParams(max_tokens=4, temperature=0))[0]
    with torch.no_grad():
        hf_logprobs = hf(torch.tensor([prompt + out.token_ids])).logits[0].float().log_softmax(-1)
    steps = torch.arange(len(prompt) - 1, len(prompt) - 1 + len(out.token_ids))
    assert out.token_ids == hf_logprobs[steps].argmax(-1).tolist()
    torch.testing.assert_close(torch.tensor(out.logprobs), hf_logprobs[steps, out.token_ids], atol=1e-4, rtol=1e-4)


def test_cache_returns_the_finished_checkpoint_without_training_and_a_changed_setting_trains(
        checkpoint, base_model, monkeypatch):
    # catches: a cache key that misses a setting (a stale checkpoint returned) or a cache that retrains
    import sliderl.trainer.sft as sft
    def no_training(*args, **kwargs):
        raise AssertionError("cached_sft trained although a finished checkpoint was there")

    monkeypatch.setattr(sft, "run_sft", no_training)
    cache = checkpoint.path.rsplit("/", 1)[0]
    again = cached_sft(cache, base_model, examples(240), examples(32, "eval"), KV, ARGS, SFT)
    assert again == checkpoint
    assert cached_sft(cache, base_model, examples(240), examples(32, "eval"), KV, ARGS,
                      dataclasses.replace(SFT, log_every=5)) == checkpoint  # logging changes no weight
    for changed in [dict(learner_args=dataclasses.replace(ARGS, lr=2e-2)), dict(kv_policy="full"),
                    dict(sft_args=dataclasses.replace(SFT, batch_size=4)), dict(train_examples=examples(239))]:
        call = dict(train_examples=examples(240), held_out_examples=examples(32, "eval"), kv_policy=KV,
                    learner_args=ARGS, sft_args=SFT) | changed
        with pytest.raises(AssertionError, match="trained"):
            cached_sft(cache, base_model, **call)


def test_training_stops_at_the_first_check_that_reaches_the_target(tmp_path, base_model, monkeypatch):
    from sliderl.trainer.learner import Learner
    from sliderl.trainer.metrics import Evaluation

    scores = iter([0.0, 0.5, 0.9])
    monkeypatch.setattr(Learner, "evaluate", lambda self, groups: Evaluation(1.0, 0.5, next(scores), 4))
    sft_args = SFTArgs(steps=12, batch_size=2, check_every=3, target_accuracy=0.4)
    result = run_sft(base_model, tmp_path / "out", examples(24), examples(4), KV, ARGS, sft_args)
    # checks after steps 3 (0.0) and 6 (0.5 >= 0.4): training stops at step 6 of 12
    assert result.steps_run == 6 and len(result.losses) == 6
    assert result.held_out_accuracy == 0.5 and result.checks == [(3, 0.0), (6, 0.5)]
    marker = json.loads((tmp_path / "out" / MARKER).read_text())
    assert marker["result"]["steps_run"] == 6 and marker["kv_policy"] == KV


def test_a_time_boxed_stage_stops_at_a_step_boundary_and_writes_its_checkpoint(tmp_path, base_model, monkeypatch):
    # catches: sft.max_seconds ignored (all 12 steps run, a time-boxed GPU recipe overruns its call) or the
    # stage stopping without its checkpoint and marker. A fake clock advances 10 s per step (the load takes
    # none): with max_seconds=25 the steps end at 10, 20, 30 s, so training stops after step 3 of 12.
    import time
    import types

    import sliderl.trainer.sft as sft
    from sliderl.trainer.learner import Learner

    clock = iter(range(0, 10_000))  # trainer.sft's own clock only: nothing else reads it
    monkeypatch.setattr(sft, "time", types.SimpleNamespace(perf_counter=lambda: 10.0 * next(clock),
                                                          process_time=time.process_time))
    step = Learner.step
    calls = []

    def counted(self, groups):
        calls.append(1)
        return step(self, groups)

    monkeypatch.setattr(Learner, "step", counted)
    result = run_sft(base_model, tmp_path / "out", examples(24), [], KV, ARGS,
                     SFTArgs(steps=12, batch_size=2, max_seconds=25))
    assert len(calls) == 3 and result.steps_run == 3
    assert json.loads((tmp_path / "out" / MARKER).read_text())["result"]["steps_run"] == 3
    assert (tmp_path / "out" / "config.json").is_file()


def test_bad_sft_settings_are_rejected_with_a_clear_message(tmp_path, base_model):
    # catches: bounds not checked in the records, or an RL algorithm silently running an SFT stage, or a list of
    # policies that is empty or holds two vocabularies
    with pytest.raises(ValueError, match="steps must be >= 1, got 0"):
        SFTArgs(steps=0)
    with pytest.raises(ValueError, match=r"target_accuracy must be in \[0, 1\].*got 1.5"):
        SFTArgs(target_accuracy=1.5)
    with pytest.raises(ValueError, match=r"max_seconds must be >= 0 \(0: no limit\), got -1"):
        SFTArgs(max_seconds=-1)
    with pytest.raises(ValueError, match="learner_args.algo must be SFTOptions"):
        run_sft(base_model, tmp_path / "x", examples(4), [], KV, LearnerArgs(algo=GRPOOptions()), SFT)
    with pytest.raises(ValueError, match="needs held-out examples"):
        run_sft(base_model, tmp_path / "x", examples(4), [], KV, ARGS, SFTArgs(target_accuracy=0.5))
    # two policies with vocabularies of their own: only one can join before tokenizing, the other's examples
    # would be tokenized as bytes
    with pytest.raises(ValueError, match="pasta and registers:16 each add their own tokens"):
        run_sft(base_model, tmp_path / "x", examples(4), [], ["registers:16", "full", "pasta"], ARGS, SFT)
    with pytest.raises(ValueError, match=r"kv=\[\] names no policy"):
        run_sft(base_model, tmp_path / "x", examples(4), [], [], ARGS, SFT)


def test_register_sft_tokenizes_registers_as_the_engine_does(tmp_path, base_model):
    # catches: the SFT stage tokenizing "<reg_3>" into 7 bytes because the registers policy's tokens
    # joined the vocabulary only at step 1, after the examples were tokenized — the model then never
    # emits a register token and the engine never evicts. The first step's loss (the start weights) must
    # equal the teacher-forced loss of the same batch tokenized with <reg_i> as single tokens, computed
    # by a separate learner bound to registers:16 up front.
    from sliderl.tasks.regmachine import RegisterMachineTask
    from sliderl.trainer.learner import Learner

    rows = RegisterMachineTask(repeats=(2, 3)).problems(4)
    pairs = [SFTExample(r["prompt"], r["solution"]) for r in rows]
    kv = "registers:16"
    result = run_sft(base_model, tmp_path / "reg", pairs, [], kv, ARGS, SFTArgs(steps=1, batch_size=4))
    reference = Learner(str(base_model), dataclasses.replace(ARGS, vocab_policy=kv))
    traces = [sft_trace(reference.tokenizer, e, kv, i) for i, e in enumerate(pairs)]
    reg_ids = set(reference.tokenizer.convert_tokens_to_ids([f"<reg_{i}>" for i in range(16)]))
    assert all(reg_ids & set(t.completion_token_ids) for t in traces)
    assert result.losses[0] == pytest.approx(reference.evaluate([traces]).loss, abs=2e-4)


def test_an_sft_over_several_policies_trains_example_i_under_the_i_th_mod_n(tmp_path, base_model):
    # catches: a list of policies where every example trains under the first (or under one chosen per batch),
    # so that a model meant to decode under prefix_sliding:8 and full learns only one of them. The first step's
    # loss (the start weights) must be the teacher-forced loss of its 4 examples under ps:8, full, ps:8, full,
    # computed by a separate learner, and not the loss under one policy for all: completions of 12+ tokens after
    # a prompt of 10+ make the two visibilities differ (a random model's loss still depends on what it sees).
    from sliderl.trainer.learner import Learner

    pairs = examples(4)
    policies = [KV, "full"]
    result = run_sft(base_model, tmp_path / "mix", pairs, [], policies, ARGS, SFTArgs(steps=1, batch_size=4))
    reference = Learner(str(base_model), ARGS)

    def loss(kvs: list[str]) -> float:
        return reference.evaluate([[sft_trace(reference.tokenizer, e, kv, i)
                                    for i, (e, kv) in enumerate(zip(pairs, kvs))]]).loss

    mixed, only_ps, only_full = loss([KV, "full", KV, "full"]), loss([KV] * 4), loss(["full"] * 4)
    assert min(abs(mixed - only_ps), abs(mixed - only_full)) > 1e-4  # the test can tell the three apart
    assert result.losses[0] == pytest.approx(mixed, abs=1e-5)
    assert json.loads((tmp_path / "mix" / MARKER).read_text())["kv_policy"] == ["prefix_sliding:8", "full"]
