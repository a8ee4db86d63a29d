"""The restart baselines (``last_k:N:K``, ``summary:N:S``) against an independent reference loop.

The reference is Hugging Face transformers run token by token over contexts built here by hand from the
Prefix Sliding paper's Appendix G rules (issue 39): a plain causal forward at fresh positions ``0 ..`` over the
current context; under last_k the context becomes the prompt plus the last K generated tokens whenever its
generated part reaches N; under summary the call's opening is forced when S tokens are left, its closing when it
reaches S tokens, and the context becomes the prompt with ``Context: <summary>`` inserted before ``<|im_end|>``.
The engine must reproduce greedy tokens exactly and sampled logprobs to 1e-4; the learner must score every
segment under the same context (and train each generated token once, never the carried context).
"""

from __future__ import annotations

import pytest
import torch
from conftest import boosted_token_model
from transformers import AutoModelForCausalLM, DynamicCache

from sliderl.core.kv_policy import KVPolicy
from sliderl.core.loader import load_model
from sliderl.core.trace import Trace
from sliderl.rollout import LLM, SamplingParams
from sliderl.trainer.learner import Learner
from sliderl.trainer.restarts import restart_logprobs

GREEDY = dict(temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 17, 99, 3], [42] * 9, list(range(60, 83))]  # P = 4, 9, 23


def hf_model(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


class Causal:
    """transformers' own KV cache over one context at positions 0..; a context that does not extend the cached
    one (a restart) is encoded afresh."""

    def __init__(self, model, temperature: float):
        self.model, self.temperature, self.ids, self.cache = model, temperature or 1.0, [], None

    def next_logprobs(self, context: list[int]) -> torch.Tensor:
        """log_softmax(logits / T) of the token after ``context``: [V] float64."""
        if self.cache is None or context[:len(self.ids)] != self.ids or len(context) == len(self.ids):
            self.ids, self.cache = [], DynamicCache()
        new = context[len(self.ids):]
        with torch.no_grad():
            out = self.model(torch.tensor([new]), position_ids=torch.arange(len(self.ids), len(context))[None],
                             cache=self.cache, use_cache=True)
        self.ids = list(context)
        return torch.log_softmax(out.logits[0, -1].double() / self.temperature, -1)


# ---- the reference loops, written from the rules (no sliderl code) ---------------------------------------
def reference_last_k(model, prompt, n, k, steps, temperature=0.0, replay=None):
    """Greedy (or, with ``replay``, the given tokens) under last_k:N:K; (tokens, logprobs, restart indices)."""
    out, logprobs, cuts, context, causal = [], [], [], list(prompt), Causal(model, temperature)
    while len(out) < steps:
        row = causal.next_logprobs(context)
        token = int(row.argmax()) if replay is None else replay[len(out)]
        out.append(token)
        logprobs.append(float(row[token]))
        context.append(token)
        if len(context) - len(prompt) == n and len(out) < steps:  # N generated: restart from the prompt + last K
            context = list(prompt) + out[-k:]
            cuts.append(len(out))
    return out, logprobs, cuts


def reference_summary(model, prompt, n, s, tool, steps, temperature=0.0, replay=None):
    """Greedy (or replayed) under summary:N:S with ``tool`` (ids: open, close, prefix, suffix, before, insert);
    (tokens, logprobs, forced flags, [(restart index, new context, forced call)])."""
    out, logprobs, forced, restarts = [], [], [], []
    context, base, call, call_forced, pending = list(prompt), len(prompt), None, False, []
    opening, closing = [tool["open"], *tool["prefix"]], [*tool["suffix"], tool["close"]]
    causal = Causal(model, temperature)
    while len(out) < steps:
        row = causal.next_logprobs(context)
        if not pending and call is None and len(context) - base == n - s:  # S left: force the call's opening
            pending, call_forced = list(opening), True
        elif not pending and call is not None and len(out) - call == s - len(closing):  # the call is full
            pending = list(closing)
        if pending:
            token, was_forced = pending.pop(0), True
        else:
            token, was_forced = (int(row.argmax()) if replay is None else replay[len(out)]), False
        out.append(token)
        logprobs.append(float(row[token]))
        forced.append(was_forced)
        context.append(token)
        if call is None and token == tool["open"]:
            call = len(out) - 1
            if not was_forced:
                pending = list(tool["prefix"])
        elif call is not None and token == tool["close"] and len(out) - call > len(opening) and len(out) < steps:
            summary = out[call + len(opening):-1]
            if tool["suffix"] and summary[-len(tool["suffix"]):] == tool["suffix"]:
                summary = summary[:-len(tool["suffix"])]
            mark = tool["insert"]  # the summary goes before the prompt's last <|im_end|>, else after the prompt
            hits = [i for i in range(len(prompt) - len(mark) + 1) if list(prompt[i:i + len(mark)]) == mark]
            at = hits[-1] if hits else len(prompt)
            context = list(prompt[:at]) + tool["before"] + summary + list(prompt[at:])
            base = len(context)
            restarts.append((len(out), list(context), call_forced))
            call, call_forced = None, False
    return out, logprobs, forced, restarts


def tool_ids(tokenizer, json_call: bool) -> dict:
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    vocab = tokenizer.get_vocab()
    return {"open": vocab["<tool_call>"], "close": vocab["</tool_call>"],
            "prefix": encode('{"name": "pass", "arguments": {"context": "') if json_call else [],
            "suffix": encode('"}}') if json_call else [], "before": encode("\nContext: "),
            "insert": encode("<|im_end|>")}


# ---- last_k ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n, k", [(12, 3), (9, 1), (16, 11)])
def test_last_k_matches_the_reference_loop(tiny_model_factory, n, k):
    path = tiny_model_factory(arch="qwen3")
    steps = 3 * n + 5
    llm = LLM(path, kv=f"last_k:{n}:{k}", block_size=4, num_blocks=64, max_num_batched_tokens=5)  # chunked re-prefill
    params = [SamplingParams(max_tokens=steps, **GREEDY), SamplingParams(max_tokens=n - 1, **GREEDY),  # never restarts
              SamplingParams(max_tokens=steps, temperature=0.8, seed=7, ignore_eos=True)]
    outs = llm.generate(PROMPTS, params)
    model = hf_model(path)
    greedy, short, sampled = outs
    tokens, logprobs, cuts = reference_last_k(model, PROMPTS[0], n, k, steps)
    assert greedy.token_ids == tokens
    assert max(abs(a - b) for a, b in zip(greedy.logprobs, logprobs)) < 1e-4
    # the budget rule: N tokens, then N - K new ones per segment (the K kept count in the context's N)
    assert cuts == list(range(n, steps + 1, n - k))[:len(cuts)] and len(cuts) >= 3
    assert [r.at for r in greedy.restarts] == cuts
    assert all(r.context_tail == tokens[r.at - k:r.at] and r.kept_prompt == 4 for r in greedy.restarts)
    assert short.token_ids == reference_last_k(model, PROMPTS[1], n, k, n - 1)[0] and not short.restarts
    _, ref_lp, cuts = reference_last_k(model, PROMPTS[2], n, k, steps, 0.8, replay=sampled.token_ids)
    assert [r.at for r in sampled.restarts] == cuts
    assert max(abs(a - b) for a, b in zip(sampled.logprobs, ref_lp)) < 1e-4
    assert greedy.reencoded_tokens == k * len(cuts)
    assert greedy.kv.peak_visible_tokens == 4 + n - 1 and greedy.kv.peak_blocks <= -(-(4 + n) // 4)
    assert llm.scheduler.blocks.num_free == 64  # a restart frees the old context's blocks


def test_last_k_overlap_equals_serial(tiny_model_factory):
    """Run-ahead never queues a row over a restart: outputs are those of serial stepping."""
    path = tiny_model_factory(arch="qwen3")
    params = SamplingParams(max_tokens=40, temperature=0.9, seed=3, ignore_eos=True)
    a, b = (LLM(path, kv="last_k:10:4", block_size=4, num_blocks=64, overlap=o).generate(PROMPTS, params)
            for o in (False, True))
    for x, y in zip(a, b):
        assert x.token_ids == y.token_ids and x.logprobs == pytest.approx(y.logprobs, abs=1e-5)
        assert x.restarts == y.restarts


def test_run_ahead_never_starves_the_sequences_a_restart_prefill_left_out(tiny_model_factory):
    """Catches run-ahead queuing steps for the sequences of a batch that the token budget cut short: here 4
    requests restart together and re-encode 16 tokens each under a 32-token budget, so a step holds two
    re-prefills and leaves two requests out; the queued steps then held the first two alone and the others waited
    until those restarted again (88 engine steps against the serial schedule's 63; on the H200 a 7.6 s stall at
    batch 256, docs/results.md). The reference is the same engine stepping serially (``overlap=False``)."""
    path = tiny_model_factory(arch="qwen3")
    prompts = [[(7 * i + j) % 200 + 32 for j in range(8)] for i in range(4)]  # 4 x 8 = the budget: one admission
    params = SamplingParams(max_tokens=60, temperature=1.0, seed=0, ignore_eos=True)
    runs = []
    for overlap in (False, True):
        llm = LLM(path, kv="last_k:32:16", block_size=16, num_blocks=64, max_num_seqs=4, max_num_batched_tokens=32,
                  max_model_len=128, overlap=overlap)
        runs.append((llm.generate(prompts, params), llm.stats.steps, llm.stats.queued_ahead))
    (serial, serial_steps, _), (ahead, ahead_steps, queued) = runs
    assert queued > 0  # run-ahead did run
    assert [o.token_ids for o in ahead] == [o.token_ids for o in serial]
    assert ahead_steps == serial_steps


# ---- summary ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def summary_model(tmp_path_factory):
    """A tiny untied Qwen3 with <tool_call>, </tool_call> whose lm_head rows are boosted so greedy decoding calls
    the tool itself now and then (and sometimes closes it itself), beside the calls summary forcing opens."""
    from sliderl.core.restart import RESTART_TOKENS

    return boosted_token_model(tmp_path_factory.mktemp("summary") / "m", tuple(RESTART_TOKENS))


CHAT = [60, 61, 62, 258, 10, 70, 71]  # "...<|im_end|>\n..." : the summary goes before the <|im_end|> (id 258)


@pytest.mark.parametrize("spec, json_call", [("summary:20:8", False), ("summary:56:50", True)])
def test_summary_matches_the_reference_loop(summary_model, spec, json_call):
    n, s = KVPolicy.parse(spec).restart_at, KVPolicy.parse(spec).carry
    steps = 60 if json_call else 3 * n  # the JSON call's prefix is 43 byte tokens: S = 50 holds a 3-token summary
    llm = LLM(summary_model, kv=spec, block_size=4, num_blocks=256, max_num_batched_tokens=6,
              summary_tool={"json_call": json_call})
    prompts = [CHAT, PROMPTS[1], CHAT]
    params = [SamplingParams(max_tokens=steps, **GREEDY), SamplingParams(max_tokens=steps, **GREEDY),
              SamplingParams(max_tokens=steps, temperature=0.8, seed=11, ignore_eos=True)]
    outs = llm.generate(prompts, params)
    model, tool = hf_model(summary_model), tool_ids(llm.tokenizer, json_call)
    calls = []
    for prompt, sp, out in zip(prompts, params, outs):
        replay = None if sp.temperature == 0 else out.token_ids
        tokens, logprobs, forced, restarts = reference_summary(model, prompt, n, s, tool, steps, sp.temperature,
                                                               replay)
        assert out.token_ids == tokens and out.forced == forced
        assert max(abs(a - b) for a, b in zip(out.logprobs, logprobs)) < 1e-4
        assert [(r.at, r.context(prompt), r.forced) for r in out.restarts] == restarts
        calls += [r.forced for r in out.restarts]
    assert True in calls and (json_call or False in calls)  # forced calls, and (short S) calls the model made
    assert llm.scheduler.blocks.num_free == 256


# ---- training: each segment under its context, each token once ---------------------------------------------
def engine_trace(out, spec: str, temperature: float) -> Trace:
    return Trace("t", "g", "p", 0, 0, spec, out.prompt_token_ids, out.token_ids, out.logprobs, out.finish_reason,
                 temperature=temperature, forced=out.forced, restarts=out.restarts)


@pytest.mark.parametrize("spec, json_call", [("last_k:10:3", False), ("summary:20:8", False)])
def test_learner_scores_each_segment_under_its_context(summary_model, spec, json_call):
    llm = LLM(summary_model, kv=spec, block_size=4, num_blocks=128, summary_tool={"json_call": json_call})
    sp = SamplingParams(max_tokens=50, temperature=0.9, seed=2, ignore_eos=True)
    out = llm.generate([CHAT], sp)[0]
    assert len(out.restarts) >= 2
    model = load_model(summary_model)
    with torch.no_grad():
        recomputed = restart_logprobs(model, out.prompt_token_ids, out.token_ids, out.restarts, temperature=0.9)
    assert (recomputed.double() - torch.tensor(out.logprobs, dtype=torch.float64)).abs().max() < 1e-4
    # the learner's rows: every generated token is a target exactly once, in order; the loss is every token the
    # sampler chose (summary included), never a forced one; the carried tokens are inputs only
    learner = Learner(summary_model, algo={"type": "grpo"}, window_mode="full", lr=0.0)
    trace = engine_trace(out, spec, 0.9)
    rows = learner._trace_rows(0, trace)
    targets = [int(t) for _, item in rows for t in item.token_ids[item.window.target_positions()]]
    assert targets == out.token_ids
    mask = torch.cat([row.loss_mask for row, _ in rows])
    assert mask.tolist() == [not f for f in out.forced]
    for (_, item), seg_start in zip(rows, [0, *[r.at for r in out.restarts]]):
        context = item.token_ids[:item.window.prompt_len].tolist()
        assert context == (out.prompt_token_ids if seg_start == 0 else
                           next(r for r in out.restarts if r.at == seg_start).context(out.prompt_token_ids))
    if spec.startswith("summary"):
        summaries = [i for r in out.restarts for i in range(r.carry_start, r.carry_end)]
        assert summaries and all(mask[i] for i in summaries)  # the model's summary is trained as its output
    # one GRPO step: the recomputed logprobs are the sampler's (mismatch < 1e-4) before the update
    low = engine_trace(llm.generate([CHAT], SamplingParams(max_tokens=50, temperature=0.9, seed=3,
                                                             ignore_eos=True))[0], spec, 0.9)
    trace.reward, low.reward = 1.0, 0.0
    metrics = learner.step([[trace, low]])
    assert metrics.stepped and metrics.logprob_diff_max < 1e-4
    assert metrics.num_loss_tokens == sum(not f for f in trace.forced) + sum(not f for f in low.forced)


def test_truncated_training_puts_the_loss_on_the_last_w_tokens_under_their_segments(tiny_model_factory):
    path = tiny_model_factory(arch="qwen3")
    out = LLM(path, kv="last_k:10:3", block_size=4, num_blocks=64).generate(
        [PROMPTS[0]], SamplingParams(max_tokens=40, **GREEDY))[0]
    cuts = [r.at for r in out.restarts]  # 10, 17, 24, 31, 38
    learner = Learner(path, algo={"type": "grpo"}, window_mode="truncated", window=12)
    rows = learner._trace_rows(0, engine_trace(out, "last_k:10:3", 0.0))
    # the last 12 tokens are 28..39: they lie in the segments [24, 31), [31, 38), [38, 40)
    assert cuts == [10, 17, 24, 31, 38]
    assert [item.window.num_generated for _, item in rows] == [7, 7, 2]
    assert [int(row.loss_mask.sum()) for row, _ in rows] == [3, 7, 2]


def test_restart_specs_parse_and_refuse_bad_values():
    assert KVPolicy.parse("last_k:4096:256").spec == "last_k:4096:256"
    assert KVPolicy.parse(" summary:4096:256").restarts and KVPolicy.parse("summary:64:8").admits_by_bound
    for bad in ("last_k:8:8", "last_k:8:0", "summary:8:1", "summary:8:9", "last_k:8"):
        with pytest.raises(ValueError, match="KV policy|needs"):
            KVPolicy.parse(bad)
