"""Warm start by SFT: the loss falls, the checkpoint loads in the engine and in transformers, the cache works."""

import json

import pytest
import torch

from rewards.arith import ArithTask
from rollout import LLM, SamplingParams
from rollout.kv_policy import KVPolicy
from rollout.loader import load_model
from rollout.model import DenseAttention, causal_mask
from rollout.tiny import build_tokenizer
from trainer.warmstart import MARKER, greedy_accuracy, make_batch, token_logprobs, warm_start

TASK = ArithTask(num_steps=(3, 4), max_operand=5, max_value=20)
TINY = dict(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64,
            steps=30, lr=1e-2, batch_size=8, warmup_steps=3, target_accuracy=0.0, train_kv="prefix_sliding:8")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return warm_start(tmp_path_factory.mktemp("warm"), TASK, **TINY)


def test_warm_start_lowers_the_sft_loss(checkpoint):
    losses = json.loads((checkpoint / MARKER).read_text())["losses"]
    assert len(losses) == TINY["steps"]
    # a random model starts near ln(vocab) = ln(259) = 5.6 nats per token; 30 steps learn the format
    assert losses[0] > 4.0
    assert sum(losses[-5:]) / 5 < 0.5 * losses[0]


def test_checkpoint_matches_transformers_and_runs_in_the_engine(checkpoint):
    from transformers import AutoModelForCausalLM

    problem = TASK.problems(1, "eval")[0]
    tokenizer = build_tokenizer()
    ids = tokenizer(problem["prompt"] + problem["solution"]).input_ids
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, local_files_only=True).eval()
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0].float()
        ours = load_model(checkpoint)
        n = len(ids)
        got = ours.compute_logits(ours(torch.tensor(ids), torch.arange(n), DenseAttention(causal_mask(n))))
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    # the trained weights are what was saved: not the random initialisation any more
    assert not torch.allclose(hf.model.embed_tokens.weight, _random_init_embedding(checkpoint))

    # the engine loads the same weights: its greedy tokens and logprobs are transformers' (full attention)
    prompt = tokenizer(problem["prompt"]).input_ids
    out = LLM(str(checkpoint), kv="full").generate([prompt], SamplingParams(max_tokens=4, temperature=0))[0]
    with torch.no_grad():
        hf_logprobs = hf(torch.tensor([prompt + out.token_ids])).logits[0].float().log_softmax(-1)
    steps = torch.arange(len(prompt) - 1, len(prompt) - 1 + len(out.token_ids))
    assert out.token_ids == hf_logprobs[steps].argmax(-1).tolist()
    torch.testing.assert_close(torch.tensor(out.logprobs), hf_logprobs[steps, out.token_ids], atol=1e-4, rtol=1e-4)


def _random_init_embedding(checkpoint):
    from rollout.tiny import make_tiny_model

    settings = json.loads((checkpoint / MARKER).read_text())["warmstart"]
    fresh = make_tiny_model(checkpoint.parent / "fresh", settings["arch"], hidden_size=settings["hidden_size"],
                            num_layers=settings["num_layers"], num_heads=settings["num_heads"],
                            num_kv_heads=settings["num_kv_heads"], intermediate_size=settings["intermediate_size"],
                            seed=settings["seed"])
    return load_model(fresh).model.embed_tokens.weight


def test_cache_returns_the_same_checkpoint_without_training(checkpoint, monkeypatch):
    import trainer.warmstart as warmstart

    def no_training(*args, **kwargs):
        raise AssertionError("warm_start trained although a finished checkpoint was there")

    monkeypatch.setattr(warmstart, "train", no_training)
    assert warm_start(checkpoint.parent, TASK, **TINY) == checkpoint
    with pytest.raises(AssertionError, match="trained"):  # other settings: a different checkpoint
        warm_start(checkpoint.parent, TASK, **{**TINY, "lr": 2e-2})


def test_training_stops_at_the_first_check_that_reaches_the_target(tmp_path, monkeypatch):
    import trainer.warmstart as warmstart

    scores = iter([0.0, 0.5, 0.9])
    monkeypatch.setattr(warmstart, "greedy_accuracy", lambda model, batch: next(scores))
    monkeypatch.setattr(warmstart, "CHECK_EVERY", 3)
    settings = {**TINY, "hidden_size": 16, "intermediate_size": 16, "batch_size": 2, "steps": 12,
                "target_accuracy": 0.4}
    record = json.loads((warm_start(tmp_path, TASK, **settings) / MARKER).read_text())
    # checks after steps 3 (0.0) and 6 (0.5 >= 0.4): training stops at step 6 of 12
    assert record["steps_run"] == 6 and len(record["losses"]) == 6
    assert record["held_out_accuracy"] == 0.5 and record["checks"] == [[3, 0.0], [6, 0.5]]


class Oracle:
    """A stand-in model whose logits put all mass on the batch's targets, except at ``wrong``."""

    training = False

    def __init__(self, batch, wrong: list[tuple[int, int]], vocab: int = 300):
        logits = torch.nn.functional.one_hot(batch.targets, vocab).float()  # [B, T, V]
        for b, t in wrong:
            logits[b, t] = torch.nn.functional.one_hot((batch.targets[b, t] + 1) % vocab, vocab).float()
        self.logits = logits.view(-1, vocab)

    def __call__(self, input_ids, positions, attn):
        return torch.arange(len(input_ids))

    def compute_logits(self, hidden):
        return self.logits[hidden]

    def eval(self):
        return self

    def train(self, mode=True):
        return self


def test_greedy_accuracy_counts_rows_whose_completion_tokens_are_all_argmax():
    tokenizer = build_tokenizer()
    batch = make_batch(tokenizer, TASK.problems(4), KVPolicy.parse("full"))
    assert greedy_accuracy(Oracle(batch, []), batch) == 1.0
    # row 0 wrong at a completion position, row 1 wrong only at a prompt position (outside the loss mask)
    completion_pos = int(batch.loss_mask[0].nonzero()[0])
    assert greedy_accuracy(Oracle(batch, [(0, completion_pos), (1, 0)]), batch) == 0.75  # rows 1, 2, 3 pass


def test_loss_mask_covers_completion_tokens_and_the_prefix_sliding_mask():
    tokenizer = build_tokenizer()
    rows = [{"prompt": "ab\n", "solution": "xyz"}, {"prompt": "abcd\n", "solution": "x"}]
    batch = make_batch(tokenizer, rows, KVPolicy.parse("prefix_sliding:2"))
    # row 0: prompt 3 tokens + "xyz" + eos = 7 tokens; targets at t = 2..5 are x, y, z, eos
    assert batch.loss_mask[0].tolist() == [False, False, True, True, True, True, False]
    assert batch.targets[0, 2:6].tolist() == [ord("x"), ord("y"), ord("z"), tokenizer.eos_token_id]
    # row 1: prompt 5 tokens + "x" + eos: targets at t = 4, 5 are x, eos
    assert batch.loss_mask[1].tolist() == [False, False, False, False, True, True, False]
    # prefix_sliding:2, prompt of 3: query 5 sees the prompt 0, 1, 2 and itself and 4 (q - k < 2)
    assert batch.visible[0, 5].tolist() == [True, True, True, False, True, True, False]
    assert batch.visible[0, 6].tolist() == [True, True, True, False, False, True, True]


def test_unknown_settings_are_rejected(tmp_path):
    with pytest.raises(ValueError, match="hiden_size"):
        warm_start(tmp_path, TASK, hiden_size=8)
    with pytest.raises(ValueError, match="registers"):
        warm_start(tmp_path, TASK, train_kv="registers:4")


def test_padded_forward_matches_dense_reference(tmp_path):
    """token_logprobs over a padded prefix_sliding batch equals a per-row DenseAttention forward."""
    from rollout.tiny import make_tiny_model

    tokenizer = build_tokenizer()
    rows = TASK.problems(3)
    policy = KVPolicy.parse("prefix_sliding:6")
    batch = make_batch(tokenizer, rows, policy)
    path = make_tiny_model(tmp_path / "dense-ref", hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                           intermediate_size=64)
    model = load_model(path, dtype=torch.float64)
    with torch.no_grad():
        got = token_logprobs(model, batch)
        for b, row in enumerate(rows):
            prompt = tokenizer(row["prompt"]).input_ids
            ids = prompt + tokenizer(row["solution"]).input_ids + [tokenizer.eos_token_id]
            n = len(ids)
            q, k = torch.arange(n)[:, None], torch.arange(n)[None, :]
            mask = (k <= q) & ((k < len(prompt)) | (q - k < 6))  # DESIGN.md's prefix_sliding:6 rule
            logits = model.compute_logits(model(torch.tensor(ids), torch.arange(n), DenseAttention(mask)))
            expected = torch.log_softmax(logits.double(), -1)[torch.arange(n - 1), torch.tensor(ids[1:])]
            torch.testing.assert_close(got[b, :n - 1].double(), expected, atol=1e-5, rtol=1e-5)

