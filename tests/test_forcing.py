"""Teacher forcing (``LLM.force``): forced tokens with the logprobs a Hugging Face forward gives them, the other rows of
the batch undisturbed, Pasta threads forced per thread against the dense reference of the runtime's tests."""

from __future__ import annotations

import pytest
import torch
from test_pasta_runtime import RESPONSE_A, assert_matches_reference, lay_out, pasta_llm, pasta_model  # noqa: F401
from transformers import AutoModelForCausalLM

from sliderl.core.pasta import PastaTokenIds
from sliderl.rollout import LLM, SamplingParams


def hf_logprobs(path, prompt: list[int], tokens: list[int], temperature: float) -> list[float]:
    """log_softmax(logits / T)[token] of each of ``tokens`` after ``prompt``, from transformers' own forward."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].double()
    logprobs = torch.log_softmax(logits / temperature, dim=-1)
    return [float(logprobs[i, t]) for i, t in enumerate(tokens)]


# catches: forced tokens given the sampler's logprob of the token it drew (not of the forced one), forcing that
# leaks into another row of the batch (rows offset by one, the whole batch forced), a script read from the wrong
# index (a token skipped or repeated), a thread that stops sampling when its script runs out, and a forced token
# the run-ahead's queued step never sees (it would feed the drawn token on)
@pytest.mark.parametrize("overlap", [False, True])
def test_forced_tokens_take_their_logprobs_and_leave_other_rows_alone(tiny_model_factory, overlap):
    path = tiny_model_factory(arch="qwen3")
    forced = [int(t) for t in torch.randint(0, 256, (12,), generator=torch.Generator().manual_seed(3))]
    a, b = [5, 6, 7, 8], [40, 41]
    sampled = SamplingParams(max_tokens=16, temperature=0.7, seed=11, ignore_eos=True)
    alone = LLM(path, kv="full", block_size=4, num_blocks=64).generate([b], sampled)[0]
    llm = LLM(path, kv="full", block_size=4, num_blocks=64, overlap=overlap)
    seq_a, seq_b = llm.add_request(a, sampled), llm.add_request(b, sampled)
    llm.force(seq_a, forced)
    while llm.scheduler.has_unfinished():
        llm.step()
    out_a, out_b = llm.output(seq_a), llm.output(seq_b)
    assert out_a.token_ids[:12] == forced and len(out_a.token_ids) == 16 and out_a.forced == [False] * 16
    assert out_a.logprobs == pytest.approx(hf_logprobs(path, a, out_a.token_ids, 0.7), abs=1e-4)
    assert out_b.token_ids == alone.token_ids and out_b.logprobs == pytest.approx(alone.logprobs, abs=1e-5)
    assert llm.runner.forced.scripts == {}  # forgotten once finished
    assert (llm.stats.queued_ahead > 0) == overlap


# catches: a fork's script read from its first output token (its <async>, inserted by the runtime) instead of
# the first one it samples, and scripts applied to the wrong thread
def test_pasta_threads_forced_match_the_dense_reference(pasta_model):  # noqa: F811
    llm = pasta_llm(pasta_model, num_blocks=256)
    prompt = list(range(40, 61))
    layout = lay_out(RESPONSE_A, PastaTokenIds.from_tokenizer(llm.tokenizer), len(prompt))
    seq = llm.add_request(prompt, SamplingParams(max_tokens=len(layout.main), temperature=0.0, ignore_eos=True))
    llm.force(seq, layout.main)
    for k, fork in enumerate(layout.forks, start=1):
        llm.force(seq, fork, thread=k)
    while llm.scheduler.has_unfinished():
        llm.step()
    assert_matches_reference(llm, llm.output(seq), layout)


# catches: a fork index accepted outside kv=pasta (silently never used) and a token id the embedding would
# index out of range
def test_bad_forcing_is_refused(tiny_model_factory):
    llm = LLM(tiny_model_factory(arch="qwen3"), kv="full", block_size=4, num_blocks=16)
    seq = llm.add_request([1, 2], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match=r"thread must be 0 \(forks exist under kv=pasta only\), got 1"):
        llm.force(seq, [3], thread=1)
    with pytest.raises(ValueError, match=r"forced token 999 is outside the vocabulary \[0, 261\)"):
        llm.force(seq, [3, 999])
