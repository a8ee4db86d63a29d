"""The Pasta-Lang runtime in the engine (``kv="pasta"``) against a dense reference built here from the rule.

Responses are written by hand (``Promise``, ``SYNC``, text); a scripted sampler (``script``) makes each thread
of the engine sample its part, and the test lays the same response out itself — the flattened tokens, the
threads, the position ids and DESIGN.md's visibility rule — then runs the model's own forward over the
whole flattened sequence with that dense mask: every token a thread sampled must have the logprob the
reference gives it at that thread's previous token.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from rollout import LLM, SamplingParams
from rollout.model import DenseAttention
from rollout.pasta import DEFAULT_PROMISE_UNITS, PASTA_TOKENS, UNIT, PastaTokenIds
from rollout.sampling import logprobs_at

EOS = 256  # the tiny tokenizer's <|endoftext|>
GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def pasta_model(tiny_model_factory):
    return tiny_model_factory(arch="qwen3", extra_special_tokens=PASTA_TOKENS)


# ---- a response written by hand -----------------------------------------------------------------
@dataclass
class Promise:
    """``<promise{attrs}/>`` on the main thread; its fork samples ``content`` then ``</async>`` (unless ``close``
    is False: the fork ends otherwise, by eos or its limit, and ``closed`` says what the runtime appends)."""

    attrs: str
    content: str | list[int]
    close: bool = True
    forks: bool = True  # False: the runtime must read it as plain text (past the fork limit, …)


SYNC = "<sync/>"


def ids_of(text: str | list[int]) -> list[int]:
    return list(text.encode()) if isinstance(text, str) else list(text)


@dataclass
class Layout:
    """What the runtime must make of a response: the scripts each thread samples, and the flattened response
    with its threads, position ids and forced flags (completion only; the prompt is thread 0 at 0 .. P-1)."""

    main: list[int]
    forks: list[list[int]]
    flat: list[int]
    thread: list[int]  # 0 main, k the k-th fork
    positions: list[int]
    forced: list[bool]
    fork_points: list[int]  # flattened index (completion) of each fork's />
    joins: list[int | None]  # flattened index (completion) of the <sync/> that joined each fork


def lay_out(pieces: list, tags: PastaTokenIds, prompt_len: int, units_default: int = DEFAULT_PROMISE_UNITS,
            eos: int = EOS) -> Layout:
    """The rule of rollout.pasta's docstring and the issue, written out independently of the runtime."""
    out = Layout([], [], [], [], [], [], [], [])
    main_next, unjoined = prompt_len, []

    def emit(token, thread, position, forced=False):
        out.flat.append(token)
        out.thread.append(thread)
        out.positions.append(position)
        out.forced.append(forced)

    for piece in pieces:
        if isinstance(piece, Promise):
            head = [tags.promise_open, *ids_of(piece.attrs), tags.tag_close]
            for tok in head:
                out.main.append(tok)
                emit(tok, 0, main_next)
                main_next += 1
            if not piece.forks:
                continue
            k = len(out.forks) + 1
            point = len(out.flat) - 1
            out.fork_points.append(point)
            content = ids_of(piece.content)
            sampled = content + [tags.async_close] if piece.close else content
            out.forks.append(sampled)
            fork_next = out.positions[point] + 1
            block = [tags.async_open, *content, tags.async_close]
            for j, tok in enumerate(block):
                emit(tok, k, fork_next + j, forced=j == 0 or (j == len(block) - 1 and not piece.close))
            digits = piece.attrs.split('tokens="')[1].split('"')[0] if 'tokens="' in piece.attrs else ""
            units = int(digits) if digits.isdigit() else units_default
            main_next = out.positions[point] + 1 + UNIT * units
            out.joins.append(None)
            unjoined.append(k)
        else:
            toks = [tags.sync] if piece == SYNC else ids_of(piece)
            for tok in toks:
                if tok == tags.sync:
                    for k in unjoined:
                        out.joins[k - 1] = len(out.flat)
                    unjoined = []
                out.main.append(tok)
                emit(tok, 0, main_next)
                main_next += 1
    return out


def dense_mask(layout: Layout, prompt_len: int) -> torch.Tensor:
    """[N, N] bool over prompt + flattened completion: a key is visible iff it precedes the query and is in the
    query's thread, or (main-thread query) in a fork joined by a <sync/> at or before it, or (fork query)
    visible to the main thread's query at the fork point."""
    thread = [0] * prompt_len + layout.thread
    points = [prompt_len + p for p in layout.fork_points]
    joins = [None if j is None else prompt_len + j for j in layout.joins]
    n = len(thread)

    def main_sees(q, k):
        return thread[k] == 0 or (joins[thread[k] - 1] is not None and joins[thread[k] - 1] <= q)

    mask = torch.zeros(n, n, dtype=torch.bool)
    for q in range(n):
        for k in range(q + 1):
            if thread[q] == 0:
                mask[q, k] = main_sees(q, k)
            else:
                mask[q, k] = thread[k] == thread[q] or (k <= points[thread[q] - 1] and main_sees(points[thread[q] - 1], k))
    return mask


def reference_logprobs(llm: LLM, prompt: list[int], layout: Layout, mask: torch.Tensor | None = None,
                       positions: list[int] | None = None) -> torch.Tensor:
    """The model's own forward over prompt + flattened response with a dense mask: ``[N, V]`` log-softmax."""
    ids = torch.tensor(prompt + layout.flat)
    pos = torch.tensor(positions if positions is not None else list(range(len(prompt))) + layout.positions)
    mask = dense_mask(layout, len(prompt)) if mask is None else mask
    with torch.no_grad():
        hidden = llm.model(ids, pos, DenseAttention(mask))
        return torch.log_softmax(llm.model.compute_logits(hidden).double(), dim=-1)


def predictors(layout: Layout, prompt_len: int) -> list[int]:
    """For each completion token, the index (prompt first) whose logits predict it: the previous token of its thread."""
    last, out = {0: prompt_len - 1}, []
    for i, t in enumerate(layout.thread, start=prompt_len):
        out.append(last.get(t, i - 1))
        last[t] = i
    return out


def assert_matches_reference(llm: LLM, out, layout: Layout, tol: float = 1e-4) -> None:
    """Flattened ids and forced flags as laid out; every sampled token's logprob as the dense reference's."""
    assert out.token_ids == layout.flat
    assert out.forced == layout.forced
    ref = reference_logprobs(llm, out.prompt_token_ids, layout)
    p = len(out.prompt_token_ids)
    rows = [(pred, tok, lp) for pred, tok, lp, f in zip(predictors(layout, p), layout.flat, out.logprobs, layout.forced)
            if not f]
    want = torch.tensor([float(ref[pred, tok]) for pred, tok, _ in rows], dtype=torch.float64)
    got = torch.tensor([lp for _, _, lp in rows], dtype=torch.float64)
    assert (want - got).abs().max() < tol


# ---- the scripted sampler ---------------------------------------------------------------------
def script(llm: LLM, scripts: dict[tuple[int, int], list[int]]) -> None:
    """Make thread ``index`` of request ``rid`` sample ``scripts[(rid, index)]`` in order (a fork's script starts
    after its <async>); the logprobs are those of the scripted tokens. Threads without a script sample freely."""
    sample = llm.runner.sample

    def scripted(seqs, logits):
        tokens, _ = sample(seqs, logits)
        for row, seq in enumerate(seqs):
            index = getattr(seq, "index", 0)
            want = scripts.get((seq.request_id, index), [])
            k = seq.num_output - (index > 0)
            if k < len(want):
                tokens[row] = want[k]
        temperature = torch.tensor([s.params.temperature for s in seqs])
        return tokens, logprobs_at(logits, tokens, temperature)

    llm.runner.sample = scripted


# ---- runtime correctness: forced responses against the dense reference ------------------------
RESPONSE_A = [
    "Go: ",
    Promise(' topic="a" tokens="1"', "alpha beta"),
    " and ",
    Promise(' topic="b" tokens="2"', "gamma"),
    " wait",
    SYNC,
    " so",
    Promise(' topic="c"', "delta epsilon zeta"),  # no tokens="N": DEFAULT_PROMISE_UNITS; never joined
    " end",
]
RESPONSE_B = [Promise(' tokens="3"', "one two three"), SYNC, "ok", SYNC, "!"]  # a second sync: no-op


def run_scripted(llm: LLM, requests: list[tuple[list[int], list | None, SamplingParams]]):
    """Generate every request at once; a request with pieces samples them (scripted), one without samples freely."""
    tags = PastaTokenIds.from_tokenizer(llm.tokenizer)
    layouts, scripts = [], {}
    for rid, (prompt, pieces, _) in enumerate(requests):
        layout = lay_out(pieces, tags, len(prompt)) if pieces is not None else None
        if layout is not None:
            scripts[(rid, 0)] = layout.main
            scripts.update({(rid, k): fork for k, fork in enumerate(layout.forks, start=1)})
        layouts.append(layout)
    script(llm, scripts)
    outs = llm.generate([p for p, _, _ in requests], [sp for _, _, sp in requests])
    return outs, layouts


def test_forced_responses_match_the_dense_reference_in_a_mixed_batch(pasta_model):
    # catches: a fork that sees the main thread's tokens after its promise or the main thread a fork before
    # its <sync/> (a table shared past the fork point), left-over slots of a left block not marked dead,
    # the position shift dropped or a fork's positions not restarting at />+1, RoPE fed table positions (or
    # the mask fed RoPE positions), the <sync/> written before its forks' last </async> (it would not see
    # it), forced <async>/</async> missing from the layout, and a plain request disturbed by its neighbours
    llm = LLM(pasta_model, kv="pasta", block_size=4, num_blocks=256, max_num_batched_tokens=16)
    tags = PastaTokenIds.from_tokenizer(llm.tokenizer)
    prompts = [list(range(40, 61)), list(range(70, 75)), [33, 34, 35]]
    main_a = lay_out(RESPONSE_A, tags, len(prompts[0])).main
    main_b = lay_out(RESPONSE_B, tags, len(prompts[1])).main
    requests = [(prompts[0], RESPONSE_A, SamplingParams(max_tokens=len(main_a), **GREEDY)),
                (prompts[1], RESPONSE_B, SamplingParams(max_tokens=len(main_b), **GREEDY)),
                (prompts[2], None, SamplingParams(max_tokens=30, **GREEDY))]
    outs, layouts = run_scripted(llm, requests)
    for out, layout in zip(outs[:2], layouts[:2]):
        assert_matches_reference(llm, out, layout)
    a = outs[0].pasta
    assert [(f.promise, f.block, f.join) for f in a.forks] == [
        ((21 + s, 21 + e), b, j) for (s, e), b, j in expected_spans(layouts[0], RESPONSE_A, tags, 21)]
    assert a.counts.promises_without_units == 1 and [f.units for f in a.forks] == [1, 2, DEFAULT_PROMISE_UNITS]
    assert [f.closed_by for f in a.forks] == ["model"] * 3 and outs[0].finish_reason == "length"
    # the dense rule really differs from full attention here, and so do the positions from 0..N-1
    ref = reference_logprobs(llm, prompts[0], layouts[0])
    full = torch.ones_like(dense_mask(layouts[0], 21)).tril()
    assert (ref - reference_logprobs(llm, prompts[0], layouts[0], mask=full)).abs().max() > 1e-2
    plain = LLM(pasta_model, kv="full", block_size=4, num_blocks=256).generate([prompts[2]], requests[2][2])[0]
    assert outs[2].token_ids == plain.token_ids and outs[2].logprobs == pytest.approx(plain.logprobs, abs=1e-5)
    assert outs[2].pasta.forks == [] and outs[2].pasta.speedup == pytest.approx(1.0)
    assert llm.scheduler.blocks.num_free == 256


def expected_spans(layout: Layout, pieces, tags, prompt_len):
    """(promise [start, end), block [start, end) prompt first, join prompt first) of each fork, from the layout."""
    spans = []
    for k, point in enumerate(layout.fork_points, start=1):
        start = max(i for i in range(point + 1) if layout.flat[i] == tags.promise_open and layout.thread[i] == 0)
        block = [i for i, t in enumerate(layout.thread) if t == k]
        join = layout.joins[k - 1]
        spans.append(((start, point + 1), (prompt_len + block[0], prompt_len + block[-1] + 1),
                      None if join is None else prompt_len + join))
    return spans
