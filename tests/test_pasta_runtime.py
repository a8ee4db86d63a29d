"""The Pasta-Lang runtime in the engine (``kv="pasta"``) against a dense reference built here from the rule.

Responses are written by hand (``Promise``, ``SYNC``, text); a scripted sampler (``script``) makes each thread
of the engine sample its part, and the test lays the same response out itself — the flattened tokens, the
threads, the position ids and DESIGN.md's visibility rule — then runs the model's own forward over the
whole flattened sequence with that dense mask: every token a thread sampled must have the logprob the
reference gives it at that thread's previous token.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import pytest
import torch

from sliderl.core.kv_policy import NEVER
from sliderl.core.loader import load_tokenizer
from sliderl.core.logprob import logprobs_at
from sliderl.core.model import DenseAttention
from sliderl.core.pasta import DEFAULT_PROMISE_UNITS, PASTA_TOKENS, UNIT, PastaTokenIds
from sliderl.rollout import LLM, SamplingParams

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
    """The rule of core.pasta's docstring and the issue, written out independently of the runtime."""
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
                point = points[thread[q] - 1]
                mask[q, k] = thread[k] == thread[q] or (k <= point and main_sees(point, k))
    return mask


def reference_logprobs(llm: LLM, prompt: list[int], layout: Layout, mask: torch.Tensor | None = None,
                       positions: list[int] | None = None) -> torch.Tensor:
    """The model's own forward over prompt + flattened response with a dense mask: ``[N, V]`` log-softmax."""
    dev = llm.device
    ids = torch.tensor(prompt + layout.flat, device=dev)
    pos = torch.tensor(positions if positions is not None else list(range(len(prompt))) + layout.positions, device=dev)
    mask = dense_mask(layout, len(prompt)) if mask is None else mask
    with torch.no_grad():
        hidden = llm.model(ids, pos, DenseAttention(mask))
        return torch.log_softmax(llm.model.compute_logits(hidden).double(), dim=-1).cpu()


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


def pasta_llm(path, **kw) -> LLM:
    """A pasta engine whose KV slots all start as live keys (death NEVER), as blocks reused from finished
    requests do: a slot the runtime should have marked dead but did not is then seen, not masked by luck."""
    llm = LLM(path, kv="pasta", block_size=4, **kw)
    llm.runner.cache.death.fill_(NEVER)
    return llm


# ---- the scripted sampler ---------------------------------------------------------------------
class script:
    """While active (``with script(llm, scripts):``), thread ``index`` of request ``rid`` samples
    ``scripts[(rid, index)]`` in order (a fork's script starts after its <async>), with those tokens'
    logprobs; threads without a script sample freely. Wraps ``llm.runner.sample``, like
    ``benchmarks/engine_gpu.py:inject_registers``."""

    def __init__(self, llm: LLM, scripts: dict[tuple[int, int], list[int]]):
        self.llm, self.scripts = llm, scripts

    def __enter__(self):
        self.sample = self.llm.runner.sample
        self.llm.runner.sample = self.scripted

    def __exit__(self, *exc):
        self.llm.runner.sample = self.sample

    def scripted(self, seqs, logits):
        tokens, _ = self.sample(seqs, logits)
        for row, seq in enumerate(seqs):
            index = getattr(seq, "index", 0)
            want = self.scripts.get((seq.request_id, index), [])
            k = seq.num_output - (index > 0)
            if k < len(want):
                tokens[row] = want[k]
        temperature = torch.tensor([s.params.temperature for s in seqs], device=logits.device)
        return tokens, logprobs_at(logits, tokens, temperature)


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


def run_scripted(llm: LLM, requests: list[tuple[list[int], list | None, SamplingParams]], on_step=None,
                 max_steps: int = 2000):
    """Run every request at once (``on_step()`` after each step, at most ``max_steps``: no deadlock); a request
    with pieces samples them (scripted), one without samples freely. Outputs and layouts in request order."""
    tags = PastaTokenIds.from_tokenizer(llm.tokenizer)
    seqs, layouts, scripts = [], [], {}
    for prompt, pieces, params in requests:
        seqs.append(llm.add_request(prompt, params))
        layout = lay_out(pieces, tags, len(prompt)) if pieces is not None else None
        if layout is not None:
            rid = seqs[-1].request_id
            scripts[(rid, 0)] = layout.main
            scripts.update({(rid, k): fork for k, fork in enumerate(layout.forks, start=1)})
        layouts.append(layout)
    with script(llm, scripts):
        for _ in range(max_steps):
            if not llm.scheduler.has_unfinished():
                break
            llm.step()
            if on_step is not None:
                on_step()
    assert not llm.scheduler.has_unfinished(), f"not finished after {max_steps} steps"
    return [llm.output(s) for s in seqs], layouts


@pytest.mark.parametrize("overlap", [False, True])
def test_forced_responses_match_the_dense_reference_in_a_mixed_batch(pasta_model, overlap):
    # catches: a fork that sees the main thread's tokens after its promise (the main thread going on in the
    # shared block), the main thread seeing a fork before the fork ended (a join that does not wait),
    # left-over slots of a left block not marked dead, the position shift dropped or a fork's positions not
    # restarting at />+1, RoPE fed table positions (or the mask fed RoPE positions), and a forced <async>
    # missing from the layout; with overlap, a queued step that writes a joining <sync/> before its join, a
    # stopped thread's queued row writing a key into a hole, and a hole left by a thread that is never
    # scheduled again (a fork ended in a queued step) left unmarked in the table of the thread that joins it
    llm = pasta_llm(pasta_model, num_blocks=256, max_num_batched_tokens=16, overlap=overlap)
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
    assert llm.scheduler.blocks.num_free == 256 and (llm.stats.queued_ahead > 0) == overlap


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


def test_critical_path_and_speedup_counted_by_hand(pasta_model):
    # catches: a fork that starts a step after the one writing its /> (each fork's chain one step longer),
    # a join one step after the last </async> is written (the main thread scheduled before its forks),
    # a request that ends with its main thread while a fork still runs, steps counted per thread, and a fork's
    # visible keys counted without what its table inherited
    llm = pasta_llm(pasta_model, num_blocks=256)
    tags = PastaTokenIds.from_tokenizer(llm.tokenizer)
    prompt = [40, 41, 42, 43, 44]
    main_a, main_b = (lay_out(r, tags, 5).main for r in (RESPONSE_A, RESPONSE_B))
    (a,), _ = run_scripted(llm, [(prompt, RESPONSE_A, SamplingParams(max_tokens=len(main_a), **GREEDY))])
    # A, one step per main token: "Go: " 1-4, promise a 5-27 (its /> at step 27); fork a samples its 11 tokens at
    # 28-38; " and " 28-32, promise b 33-55; fork b samples 6 tokens at 56-61, " wait" 56-60, <sync/> at 61: step 62
    # writes fork b's </async> and the <sync/> together; " so" 62-64, promise c 65-76; " end" 77-80 (max_tokens);
    # fork c samples its 19 tokens at 77-95 and the request ends there
    assert (len(main_a), [len(f) for f in lay_out(RESPONSE_A, tags, 5).forks]) == (80, [11, 6, 19])
    assert a.pasta.steps == 95 and len(a.token_ids) == 80 + 3 + 11 + 6 + 19
    assert a.pasta.speedup == pytest.approx(119 / 95)
    # the most keys one query saw: fork c's last, its table the prompt (5), the main thread through c's />
    # (76), the joined blocks of a and b (12 + 7) and its own <async> and 18 tokens
    assert a.kv.peak_visible_tokens == 5 + 76 + 12 + 7 + 19
    (b,), _ = run_scripted(llm, [(prompt, RESPONSE_B, SamplingParams(max_tokens=len(main_b), **GREEDY))])
    # B: promise 1-13; its fork samples 14 tokens at 14-27 while the main thread waits at <sync/> (step 14);
    # step 28 writes </async> and <sync/> and samples "o"; "k", <sync/>, "!" at 29-31
    assert b.pasta.steps == 31 and len(b.token_ids) == 18 + 15
    assert llm.scheduler.blocks.num_free == 256


def test_overlap_starts_a_fork_and_joins_a_step_later_counted_by_hand(pasta_model):
    # catches: run-ahead left off under pasta, or a change to the threads that lets queued steps run on
    # without it (a fork would start only when its main thread stops being queued ahead, at its <sync/>),
    # counted against the serial A and B of test_critical_path_and_speedup_counted_by_hand (95 and 31 steps)
    llm = pasta_llm(pasta_model, num_blocks=256, overlap=True)
    main = lay_out(RESPONSE_B, PastaTokenIds.from_tokenizer(llm.tokenizer), 5).main
    (out,), (layout,) = run_scripted(llm, [([40, 41, 42, 43, 44], RESPONSE_B,
                                           SamplingParams(max_tokens=len(main), **GREEDY))])
    assert_matches_reference(llm, out, layout)
    # B: promise 1-13 (the /> sampled at 13, its fork known after step 14 was queued); step 14 writes the />
    # and samples <sync/>; the fork starts at 15 and samples its 14 tokens at 15-28; step 29 (queued) writes
    # its </async>; step 30 joins and writes the <sync/>, samples "o"; "k", <sync/>, "!" at 31-33
    assert out.pasta.steps == 33 and llm.stats.queued_ahead > 0
    main = lay_out(RESPONSE_A, PastaTokenIds.from_tokenizer(llm.tokenizer), 5).main
    (out,), (layout,) = run_scripted(llm, [([40, 41, 42, 43, 44], RESPONSE_A,
                                           SamplingParams(max_tokens=len(main), **GREEDY))])
    assert_matches_reference(llm, out, layout)
    # A (95 serial steps): the main thread samples a token every step up to its <sync/> (61); forks a and b
    # start at 29 and 57 (a step late) and b samples its 6 tokens at 57-62; step 62 (queued) drops the main
    # thread's <sync/> row, step 63 writes b's </async> and joins; " so" 63-65, promise c 66-77 (its /> at 77),
    # " end" 78-81; fork c starts at 79 and samples its 19 tokens at 79-97
    assert out.pasta.steps == 97


@pytest.mark.parametrize("overlap", [False, True])
def test_edge_cases_of_the_annotation(pasta_model, overlap):
    # catches: a promise inside a fork read as a tag (it is text), a fork ended by eos or by its token limit
    # left without </async>, an invalid tokens="..." not defaulted, an unclosed <promise swallowing the
    # <sync/> that interrupts it, and a request that ends with its main thread's eos while a fork runs
    llm = pasta_llm(pasta_model, num_blocks=256, max_num_batched_tokens=8, overlap=overlap)
    tags = PastaTokenIds.from_tokenizer(llm.tokenizer)
    po, tc = tags.promise_open, tags.tag_close
    limit = 60
    edge = [
        SYNC, "x",  # nothing to join: plain
        Promise(' tokens="oops"', [*b"ab", EOS], close=False),  # DEFAULT_PROMISE_UNITS; eos closes the fork
        Promise(' tokens="1"', [*b"p", po, *b' tokens="2"', tc, *b"q"]),  # a promise inside a fork: text
        [po, *b" t"], SYNC,  # a <promise interrupted by <sync/>, which joins both forks
        "y",
        Promise(' tokens="2"', [97 + i % 26 for i in range(limit)], close=False),  # closed at max_tokens sampled
        "z", [EOS],  # the main thread stops on eos; the last fork runs on
    ]
    params = SamplingParams(max_tokens=limit, temperature=0.0)
    assert len(lay_out(edge, tags, 3).main) < limit
    (out,), (layout,) = run_scripted(llm, [([7, 8, 9], edge, params)])
    assert_matches_reference(llm, out, layout)
    pasta = out.pasta
    assert [f.closed_by for f in pasta.forks] == ["stop", "model", "length"] and out.finish_reason == "stop"
    assert [f.join for f in pasta.forks][2] is None and pasta.forks[0].join == pasta.forks[1].join
    assert (pasta.counts.promises_without_units, pasta.counts.promises_in_forks, pasta.counts.stray_tags,
            pasta.counts.unclosed_promises, pasta.counts.forks_closed_by_runtime) == (1, 1, 1, 1, 2)
    assert llm.scheduler.blocks.num_free == 256


@pytest.mark.parametrize("overlap", [False, True])
def test_one_token_per_step_joins_after_the_last_async_close_is_written(pasta_model, overlap):
    # catches: a join that waits only for its forks to stop, not for their last </async> to be written: with
    # one token per step the main thread's <sync/> and the fork's </async> cannot share a forward, so the
    # <sync/> would not see it (the forks-first order of a waiting main thread alone hides this at wider steps)
    llm = pasta_llm(pasta_model, num_blocks=64, max_num_batched_tokens=1, pasta_max_forks=1, overlap=overlap)
    main = lay_out(RESPONSE_B, PastaTokenIds.from_tokenizer(llm.tokenizer), 5).main
    (out,), (layout,) = run_scripted(llm, [([40, 41, 42, 43, 44], RESPONSE_B,
                                           SamplingParams(max_tokens=len(main), **GREEDY))])
    assert_matches_reference(llm, out, layout)


@pytest.mark.parametrize("overlap", [False, True])
def test_fork_limit_and_a_promise_closed_by_the_last_token_are_text(pasta_model, overlap):
    # catches: a promise past pasta_max_forks forking anyway (or shifting the positions after it), and a
    # fork started by a /> on which the main thread stopped (its KV is never written)
    llm = pasta_llm(pasta_model, num_blocks=256, pasta_max_forks=1, overlap=overlap)
    over = [Promise(' tokens="1"', "ab"), "c", Promise(' tokens="2"', "zz", forks=False), "d", SYNC, "e"]
    last = ["a", Promise(' tokens="1"', "", forks=False)]
    tags = PastaTokenIds.from_tokenizer(llm.tokenizer)
    requests = [([5, 6], pieces, SamplingParams(max_tokens=len(lay_out(pieces, tags, 2).main), **GREEDY))
                for pieces in (over, last)]
    outs, layouts = run_scripted(llm, requests)
    for out, layout in zip(outs, layouts):
        assert_matches_reference(llm, out, layout)
    assert len(outs[0].pasta.forks) == 1 and outs[0].pasta.counts.promises_over_limit == 1
    assert outs[1].pasta.forks == [] and outs[1].pasta.counts.promises_unforked == 1


# ---- one pool for every thread: preemption, many requests ---------------------------------------
def test_block_bound_counts_the_forks_and_refuses_what_cannot_fit_alone(pasta_model):
    # catches: a bound that leaves the forks out (a request admitted into a pool it cannot finish in
    # alone: it would stop mid-run with "cannot hold request alone"), and a message without the numbers
    # P = 9, max_tokens = 40, B = 4: the main thread's ceil(49 / 4) = 13 blocks, then per fork a part-filled
    # block at its promise and one at its join, plus its own ceil((40 + 2) / 4) = 11: 13 + 2 x 13 = 39
    llm = pasta_llm(pasta_model, num_blocks=38, pasta_max_forks=2)
    assert llm.max_concurrency(9, 40) == 0
    with pytest.raises(ValueError, match=r"9 prompt tokens and max_tokens=40 may hold 39 KV blocks of 4 tokens under "
                                         r"pasta .* more than the whole pool of 38 blocks; .* pasta_max_forks=2"):
        llm.add_request(list(range(1, 10)), SamplingParams(max_tokens=40, **GREEDY))
    tags = PastaTokenIds.from_tokenizer(llm.tokenizer)
    main = lay_out(RESPONSE_A, tags, 9).main  # 80 tokens, 3 forks: alone in a pool of exactly its bound
    bound = -(-(9 + 80) // 4) + 3 * (2 + -(-(80 + 2) // 4))
    llm = pasta_llm(pasta_model, num_blocks=bound, pasta_max_forks=3)
    (out,), (layout,) = run_scripted(llm, [(list(range(1, 10)), RESPONSE_A, SamplingParams(max_tokens=80, **GREEDY))])
    assert len(main) == 80 and out.kv.peak_blocks <= bound
    assert_matches_reference(llm, out, layout)
    assert llm.scheduler.blocks.num_free == bound



@pytest.mark.parametrize("overlap", [False, True])
def test_tiny_pool_with_preemption_equals_each_request_alone(pasta_model, overlap):
    # catches: a preempted request resumed with its tables rebuilt wrong (a join not redone, holes not marked
    # dead in the new blocks), one thread left behind by a preemption, a shared block returned to the pool
    # while another thread holds it, and outputs that depend on what else shares the batch
    gen = torch.Generator().manual_seed(0)
    # the main thread waits 30 steps at its <sync/>: its fork samples 44 tokens (within max_tokens = 13 + 1 + 36)
    wait = [Promise(' tokens="4"', "the quick brown fox jumps over the lazy dog"), SYNC,
            "and that, at last, is the end of it."]
    responses = [RESPONSE_A, RESPONSE_B, None, wait, RESPONSE_A, None, RESPONSE_B, wait, RESPONSE_A, None, wait,
                 RESPONSE_B, wait, None]
    tags = PastaTokenIds.from_tokenizer(load_tokenizer(pasta_model))
    requests = []
    for i, pieces in enumerate(responses):
        prompt = torch.randint(0, 256, (int(torch.randint(2, 13, (1,), generator=gen)),), generator=gen).tolist()
        length = len(lay_out(pieces, tags, len(prompt)).main) if pieces else 24
        sampled = dict(temperature=0.8, seed=i) if pieces is None and i % 2 else dict(temperature=0.0)
        requests.append((prompt, pieces, SamplingParams(max_tokens=length, ignore_eos=True, **sampled)))
    alone = pasta_llm(pasta_model, num_blocks=512, pasta_max_forks=3)
    refs = [run_scripted(alone, [r])[0][0] for r in requests]
    # A's bound: ceil(92 / 4) = 23 blocks for the main thread + 3 forks x (2 + ceil(82 / 4)) = 92 of the 96
    pool = 96
    llm = pasta_llm(pasta_model, num_blocks=pool, pasta_max_forks=3, max_num_batched_tokens=32, overlap=overlap)
    preempted = []  # (had forks, its main thread waited at a sync)
    preempt = llm.scheduler._preempt

    def recording_preempt(seq, batch=None):
        request = seq.main.request
        preempted.append((bool(request.forks), request.schedule_order()[-1] is request.main and bool(request.forks)))
        preempt(seq, batch)

    llm.scheduler._preempt = recording_preempt

    def refcounts_match():  # every block's count is the number of table entries holding it
        held = Counter(b for thread in llm.scheduler.running for b in thread.blocks.values())
        assert all(llm.scheduler.blocks.ref_count(b) == held[b] for b in range(pool))
        assert llm.scheduler.blocks.num_free == pool - len(held)

    outs, layouts = run_scripted(llm, requests, on_step=refcounts_match)
    assert any(forks for forks, _ in preempted) and any(waiting for _, waiting in preempted)
    for out, ref, layout in zip(outs, refs, layouts):
        assert out.token_ids == ref.token_ids and out.forced == ref.forced
        assert out.logprobs == pytest.approx(ref.logprobs, abs=1e-5)
        assert out.pasta.forks == ref.pasta.forks and out.pasta.counts == ref.pasta.counts
        if layout is not None:
            assert_matches_reference(llm, out, layout)
    assert sum(o.num_preemptions for o in outs) == llm.stats.preemptions
    assert llm.scheduler.blocks.num_free == pool and all(llm.scheduler.blocks.ref_count(b) == 0 for b in range(pool))
    assert (llm.stats.queued_ahead > 0) == overlap


@pytest.mark.parametrize("device", [pytest.param("cpu", marks=pytest.mark.slow),
                                    pytest.param("cuda", marks=pytest.mark.gpu)])
def test_triton_kernels_mask_pasta_tables_like_the_reference(pasta_model, device):
    # catches: the Triton decode or prefill kernel (or a captured decode graph) masking Pasta tables
    # differently from the dense rule (query positions other than table positions, holes not dead); on CPU
    # the kernels run under TRITON_INTERPRET=1 (~25 s), on CUDA with decode graphs; both with overlap (the
    # CUDA default), whose queued steps write dead slots and drop stale rows
    from sliderl import kernels
    llm = pasta_llm(pasta_model, num_blocks=64, max_num_batched_tokens=8, pasta_max_forks=2, device=device,
                    overlap=True)
    llm.runner.impl = kernels  # on CPU: the CUDA path's kernels, interpreted
    tags = PastaTokenIds.from_tokenizer(llm.tokenizer)
    short = [Promise(' tokens="1"', "ab"), "c", Promise(' tokens="1"', "de f"), SYNC, "gh"]
    main = lay_out(short, tags, 6).main
    outs, layouts = run_scripted(llm, [(list(range(50, 56)), short, SamplingParams(max_tokens=len(main), **GREEDY)),
                                       ([9, 10, 11], None, SamplingParams(max_tokens=6, **GREEDY))])
    assert_matches_reference(llm, outs[0], layouts[0])
    plain = LLM(pasta_model, kv="full", block_size=4, num_blocks=64, device=device).generate(
        [[9, 10, 11]], SamplingParams(max_tokens=6, **GREEDY))
    assert outs[1].token_ids == plain[0].token_ids and llm.stats.queued_ahead > 0


@pytest.mark.parametrize("overlap", [False, True])
def test_main_threads_waiting_at_syncs_do_not_starve_their_forks(pasta_model, overlap):
    # catches: a deadlock when every main thread waits at a <sync/> and their forks want blocks the pool no
    # longer has (a fork that waits for room instead of preempting the newest request: nothing would ever
    # be freed), and outputs of requests preempted while waiting that differ from each alone
    # each request: the main thread writes its promise and waits at <sync/> while the fork samples 44 tokens;
    # bound (P = 4, max_tokens = 50, one fork): ceil(54 / 4) = 14 + (2 + ceil(52 / 4)) = 29 blocks, the whole pool;
    # three requests run at once and each reaches about 4 + 12 blocks with its fork
    wait = [Promise(' tokens="4"', "the quick brown fox jumps over the lazy dog"), SYNC,
            "and that, at last, is the end of it."]
    tags = PastaTokenIds.from_tokenizer(load_tokenizer(pasta_model))
    prompts = [[11, 12, 13, 14], [21, 22, 23, 24], [31, 32, 33, 34]]
    length = len(lay_out(wait, tags, 4).main)
    requests = [(p, wait, SamplingParams(max_tokens=length, **GREEDY)) for p in prompts]
    assert length == 50
    llm = pasta_llm(pasta_model, num_blocks=29, pasta_max_forks=1, overlap=overlap)
    outs, layouts = run_scripted(llm, requests, max_steps=500)
    assert llm.stats.preemptions > 0
    alone = pasta_llm(pasta_model, num_blocks=64, pasta_max_forks=1)
    for out, layout, request in zip(outs, layouts, requests):
        ref = run_scripted(alone, [request])[0][0]
        assert out.token_ids == ref.token_ids and out.logprobs == pytest.approx(ref.logprobs, abs=1e-5)
        assert_matches_reference(llm, out, layout)
    assert llm.scheduler.blocks.num_free == 29 and (llm.stats.queued_ahead > 0) == overlap


def test_text_is_the_flattened_response_cut_where_the_main_thread_stopped(pasta_model):
    # catches: a text decoded from the main thread alone (forks missing), and a cut at the first stop string
    # of the flattened text (the fork's "STOP" is text: only the main thread's stop string ends the request)
    llm = pasta_llm(pasta_model, num_blocks=256)
    pieces = [Promise(' tokens="1"', "a STOP b"), "c", SYNC, "dSTOP"]
    tags = PastaTokenIds.from_tokenizer(llm.tokenizer)
    params = SamplingParams(max_tokens=64, stop=["STOP"], **GREEDY)
    (out,), (layout,) = run_scripted(llm, [([1, 2, 3], pieces, params)])
    assert out.finish_reason == "stop" and out.token_ids == layout.flat
    assert out.text == llm.tokenizer.decode(layout.flat)[:-len("STOP")]
    assert out.pasta.forks[0].closed_by == "model" and tags.async_close in out.token_ids


@pytest.mark.parametrize("overlap", [False, True])
def test_max_model_len_caps_every_threads_positions(pasta_model, overlap):
    # catches: a fork closed past max_model_len (its </async> written at position max_model_len or later), and a
    # main thread whose shifted positions are not capped (it would sample past max_model_len - 1)
    llm = pasta_llm(pasta_model, num_blocks=256, max_model_len=40, overlap=overlap)
    # prompt 0..2, <promise 3, attributes 4..14, /> 15; the fork's <async> at 16 samples at 17..38 (22 tokens)
    # and its </async> lands at 39 = max_model_len - 1; the main thread goes on at 15 + 1 + 20 = 36 and stops
    # after sampling the token at position 39
    pieces = [Promise(' tokens="2"', "abcdefghijklmnopqrstuv", close=False), "wxyz"]
    (out,), (layout,) = run_scripted(llm, [([1, 2, 3], pieces, SamplingParams(max_tokens=64, **GREEDY))])
    assert_matches_reference(llm, out, layout)
    assert max(layout.positions) == 39 and out.finish_reason == "length"
    assert out.pasta.forks[0].closed_by == "length"
