"""Paged H2O (``h2o:B``): the spec, the engine's budget and evictions, the recorded deaths, the trainer.

The engine's evictions are checked against an independent recomputation: a float64 dense forward of
the same model over the whole sequence, masked by the recorded deaths (``k <= q < death[k]``), whose
attention probabilities summed per page over heads, layers and earlier queries must rank every
evicted page below every page the budget kept. The trainer rescoring the traces must match the
sampler's logprobs, which only holds when it builds the mask from the recorded deaths.
"""

from __future__ import annotations

import math

import pytest
import torch

from sliderl.core.kv_policy import NEVER, KVPolicy
from sliderl.core.loader import load_model
from sliderl.core.trace import Trace, traces_from_table, traces_to_table
from sliderl.rollout import LLM, SamplingParams
from sliderl.rollout.block_bound import block_bound
from sliderl.trainer.learner import Learner
from sliderl.trainer.logprobs import trace_logprobs

BS, BUDGET = 4, 16  # pages of 4 tokens: 4 pages in the budget, the 2 most recent always kept
BUDGET_PAGES, RECENT = 4, 2
PROMPTS = [list(range(10, 30)), [5, 6, 7], list(range(40, 51))]  # 5 pages, under one page, 2.75 pages


def generate(path, overlap: bool, max_tokens: int = 40):
    llm = LLM(str(path), kv=f"h2o:{BUDGET}", block_size=BS, num_blocks=64, overlap=overlap)
    params = [SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=3, ignore_eos=True),
              SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=4, ignore_eos=True)]
    return llm, llm.generate(PROMPTS, params), params


def page_deaths(out) -> dict[int, int]:
    """Logical page -> its recorded death; checks every range is one whole page."""
    deaths = {}
    for start, end, death in out.kv_deaths:
        assert start % BS == 0 and end == start + BS, (start, end)  # whole pages only
        assert start // BS not in deaths, "a page evicted twice"
        deaths[start // BS] = death
    return deaths


def live_pages(deaths: dict[int, int], q: int) -> int:
    """Pages the query at q sees some key of: written by then and not evicted before q."""
    return sum(1 for j in range(q // BS + 1) if deaths.get(j, NEVER) > q)


class MassRecorder:
    """Dense float64 attention under an explicit mask that also sums each key's probability over heads and layers."""

    def __init__(self, mask: torch.Tensor):
        self.mask = mask
        self.key_mass = torch.zeros(mask.shape, dtype=torch.float64)  # [query, key]

    def __call__(self, layer, q, k, v):
        groups = q.shape[1] // k.shape[1]
        k, v = k.double().repeat_interleave(groups, 1), v.double().repeat_interleave(groups, 1)
        scores = torch.einsum("qhd,khd->hqk", q.double(), k) / math.sqrt(q.shape[2])
        probs = scores.masked_fill(~self.mask[None], float("-inf")).softmax(-1)  # [H_q, N, N]
        self.key_mass += probs.sum(0)
        return torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)


def dense_page_mass(path, out) -> torch.Tensor:
    """``[N, pages]``: row q = the mass each page received from queries 0..q, from a float64 forward over the
    recorded deaths."""
    ids = torch.tensor(out.prompt_token_ids + out.token_ids)
    n = ids.shape[0]
    death = KVPolicy.parse(f"h2o:{BUDGET}").death_positions(len(out.prompt_token_ids), ids, out.kv_deaths)
    pos = torch.arange(n)
    mask = (pos[None, :] <= pos[:, None]) & (pos[:, None] < death[None, :])
    recorder = MassRecorder(mask)
    model = load_model(path, dtype=torch.float64)
    with torch.no_grad():
        model(ids, pos, recorder)
    pages = -(-n // BS)
    per_page = torch.nn.functional.pad(recorder.key_mass, (0, pages * BS - n)).view(n, pages, BS).sum(2)
    return per_page.cumsum(0)


@pytest.mark.parametrize("overlap", [False, True])
def test_generation_keeps_the_budget_and_records_every_eviction(tiny_model_factory, overlap):
    """Catches: the budget counted in tokens instead of whole pages or off by a page, a recent page (the one
    being written) evicted, a partial page evicted, the block bound too small for the unscored first
    steps (admission's assert), a page evicted after a step that saw it was launched (the overlap lag
    recorded as a later death). Planted: one page over the budget, one recent page fewer — each fails."""
    path = tiny_model_factory(arch="qwen3")
    llm, outs, _ = generate(path, overlap)
    assert llm.stats.preemptions == 0
    for out, prompt in zip(outs, PROMPTS):
        p, n = len(prompt), len(prompt) + len(out.token_ids)
        deaths = page_deaths(out)
        assert len(out.token_ids) == 40 and deaths  # 43+ positions in 4 pages: pages must go
        bound = block_bound(llm.policy, p, 40, llm.max_model_len, BS, llm.args.max_num_batched_tokens)
        assert out.kv.peak_blocks <= bound
        for j, death in deaths.items():
            assert (j + 1) * BS <= death < n  # a whole written page, evicted before a real query
            assert j <= death // BS - RECENT  # never one of the recent pages of the step it died at
        for q in range(p, n - 1):  # every decode query (the last token is never a query)
            assert live_pages(deaths, q) <= bound
            if q >= p + 2:  # the prompt's mass is in by then, with or without overlap
                assert live_pages(deaths, q) <= BUDGET_PAGES, (q, live_pages(deaths, q))
        assert out.kv.peak_visible_tokens <= max(BUDGET, BS * bound)


def test_evicted_pages_are_the_lowest_mass_ones(tiny_model_factory):
    """Without overlap, an eviction at position a uses the mass of queries 0..a-1 (prefill included).

    Recomputed by a float64 dense forward over the recorded deaths: every page evicted at a has no more
    mass than any older page kept at a, and exactly enough pages go to fit the budget. Catches: the
    heavy pages' role inverted (keeping the lightest pages, evicting the heaviest), mass not accumulated
    over steps (the last step's only), prefill mass dropped, a page over the budget. Planted: victims
    sorted by descending mass, mass replaced instead of added, no mass from the prefill path, one page
    over the budget — each fails. (Dropping one layer's mass does not: the tiny random model's two
    layers rank pages alike; the kernel tests pin the per-layer sum over heads.)
    """
    path = tiny_model_factory(arch="qwen3")
    _, outs, _ = generate(path, overlap=False)
    checked = 0
    for out, prompt in zip(outs, PROMPTS):
        deaths = page_deaths(out)
        mass = dense_page_mass(path, out)  # [N, pages], cumulative over queries
        for a in sorted(set(deaths.values())):
            gone = [j for j, d in deaths.items() if d == a]
            held = [j for j in range(a // BS + 1) if deaths.get(j, NEVER) >= a]  # before the eviction at a
            assert len(held) - len(gone) == BUDGET_PAGES  # exactly down to the budget
            kept = [j for j in held if j not in gone and j <= a // BS - RECENT]
            seen = mass[a - 1]  # queries 0 .. a-1
            for j in gone:
                for i in kept:
                    assert seen[j] <= seen[i] + 1e-5, (a, j, float(seen[j]), i, float(seen[i]))
                    checked += 1
    assert checked > 20


@pytest.mark.parametrize("overlap", [False, True])
def test_trainer_rescoring_an_h2o_trace_matches_the_sampler(tiny_model_factory, overlap):
    """The trainer's mask comes from the trace's recorded deaths (through Parquet), so its logprobs equal the
    sampler's within 1e-4; without them (the policy alone never evicts) they do not. Catches: the deaths
    not passed from RequestOutput to Trace or through the Parquet row, the trainer ignoring
    ``kv_deaths``, a death off by one position. Planted: the engine recording death = a + 1, the Learner
    ignoring ``trace.death_ranges``, ``Trace.from_row`` dropping ``kv_deaths`` — each fails."""
    path = tiny_model_factory(arch="qwen3")
    _, outs, params = generate(path, overlap, max_tokens=30)
    traces = [Trace(f"t{i}", "g", "p", 0, 0, f"h2o:{BUDGET}", out.prompt_token_ids, out.token_ids, out.logprobs,
                    out.finish_reason, temperature=sp.temperature, reward=float(i),
                    kv_deaths=Trace.flat_deaths(out.kv_deaths))
              for i, (out, sp) in enumerate(zip(outs, params))]
    traces = traces_from_table(traces_to_table(traces))  # what the learner reads back from the trace log
    model = load_model(path)
    for trace in traces:
        assert trace.kv_deaths
        sampler = torch.tensor(trace.logprobs, dtype=torch.float64)
        with torch.no_grad():
            rescored = trace_logprobs(model, trace).double()
            blind = trace_logprobs(model, Trace(**{**vars(trace), "kv_deaths": []})).double()
        assert (rescored - sampler).abs().max() < 1e-4
        assert (blind - sampler).abs().max() > 1e-2  # the recorded deaths matter
    learner = Learner(str(path), lr=1e-3)
    metrics = learner.step([traces])
    assert metrics.logprob_diff_max < 1e-4  # the Learner's own recomputation (its mismatch metric)


def test_h2o_specs_and_budget_errors(tiny_model_factory):
    assert KVPolicy.parse("h2o:64").spec == "h2o:64" and KVPolicy.parse("h2o:64").admits_by_bound
    for bad, said in [("h2o:0", "budget must be >= 1, got 0"), ("h2o:x", "non-integer"), ("h2o", "takes 1")]:
        with pytest.raises(ValueError, match=said) as err:
            KVPolicy.parse(bad)
        assert "h2o:B" in str(err.value)  # the valid specs are listed
    path = tiny_model_factory(arch="qwen3")
    with pytest.raises(ValueError, match=r"h2o:7 needs a budget of at least 2 pages.*8"):
        LLM(str(path), kv="h2o:7", block_size=4)
    row = Trace("t", "g", "p", 0, 0, "full", [1], [2], [-1.0], "length").to_row()
    del row["kv_deaths"]  # a trace log written before h2o
    assert Trace.from_row(row).kv_deaths == []
    with pytest.raises(ValueError, match="kv_deaths range"):
        Learner(str(path)).step([[Trace("t", "g", "p", 0, 0, "h2o:16", [1, 2], [3], [-1.0], "length",
                                        kv_deaths=[0, 2, 1])]])  # dies before its last key is written


@pytest.mark.gpu
@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("graphs", [False, True])
def test_cuda_h2o_traces_rescore_on_the_cpu_trainer(tiny_model_factory, overlap, graphs):
    """On CUDA the decode kernel's mass output drives the evictions (prefill chunks: the torch reference),
    eagerly or from captured graphs (the mass in their static buffer); whatever it evicts, the recorded deaths
    let the CPU trainer rescore the trace. Catches a GPU-only death or mass path that disagrees with what the
    kernels attended to."""
    path = tiny_model_factory(arch="qwen3")
    llm = LLM(str(path), kv="h2o:32", device="cuda", dtype="float32", block_size=8, num_blocks=256, overlap=overlap,
              cuda_graphs=graphs)
    outs = llm.generate([list(range(10, 90)), [5, 6, 7]],
                        SamplingParams(max_tokens=100, temperature=0.8, seed=1, ignore_eos=True))
    assert (llm.runner.graphs is not None and llm.runner.graphs.replays > 0) == graphs
    model = load_model(path)
    for out in outs:
        assert out.kv_deaths and out.kv.peak_blocks <= max(4, -(-(len(out.prompt_token_ids) + 2) // 8))
        trace = Trace("t", "g", "p", 0, 0, "h2o:32", out.prompt_token_ids, out.token_ids, out.logprobs, "length",
                      temperature=0.8, kv_deaths=Trace.flat_deaths(out.kv_deaths))
        with torch.no_grad():
            err = (trace_logprobs(model, trace).double() - torch.tensor(out.logprobs).double()).abs().max()
        assert err < 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("overlap", [False, True])
def test_cuda_h2o_graph_replay_evicts_what_the_eager_engine_evicts(tiny_model_factory, overlap):
    """Decode steps replayed from CUDA graphs pick the same pages as eager steps: same greedy tokens, same recorded
    deaths, logprobs within fp32 noise. Catches the graphs' static mass buffer not zeroed before each replay
    (mass would accumulate across steps), the mass not passed to the captured decode kernel (all zeros: the
    oldest candidate goes), or a mass copy read after the next replay rewrote the buffer (run-ahead on)."""
    path = tiny_model_factory(arch="qwen3")
    prompts = [list(range(10, 90)), [5, 6, 7], list(range(40, 73))]
    sp = SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)
    outs = {}
    for graphs in (False, True):
        llm = LLM(str(path), kv="h2o:32", device="cuda", dtype="float32", block_size=8, num_blocks=256,
                  overlap=overlap, cuda_graphs=graphs)
        outs[graphs] = llm.generate(prompts, sp)
        if graphs:
            assert llm.runner.graphs.replays > 0
        llm.close()
    for eager, replayed in zip(outs[False], outs[True]):
        assert eager.kv_deaths  # the budget evicted pages, so the mass chose them
        assert replayed.token_ids == eager.token_ids
        assert replayed.kv_deaths == eager.kv_deaths
        assert max(abs(a - b) for a, b in zip(eager.logprobs, replayed.logprobs)) < 1e-3
