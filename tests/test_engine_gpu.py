"""The GPU engine path (Triton kernels, CUDA graphs) against the CPU path: same tokens, fp32 greedy."""

from __future__ import annotations

import gc

import pytest
import torch

from sliderl.rollout import LLM, SamplingParams

pytestmark = pytest.mark.gpu

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("spec", ["full", "prefix_sliding:24", "sliding_window:24", "streaming:4:24", "registers:4",
                                  "h2o:32"])
@pytest.mark.parametrize("graphs", [True, False])
def test_gpu_matches_cpu_fp32(tiny_model_factory, spec, graphs):
    """h2o: the CPU engine's mass (the torch reference) against the decode kernel's, eager or replayed; a wrong mass
    evicts other pages and the greedy tokens part."""
    path = tiny_model_factory(arch="qwen3", hidden_size=128, num_heads=8, num_kv_heads=2, intermediate_size=256)
    prompts = [list(range(10, 10 + n)) for n in (3, 17, 40, 64, 5)]
    sp = SamplingParams(max_tokens=120, **GREEDY)
    # h2o evicts with the mass read back so far, one step older when CUDA's run-ahead overlap is on (the
    # default there; rollout.heavy_hitters): the CPU reference runs with the same overlap, else the 64-token
    # prompt (two prefill chunks) loses its pages one step later on the GPU and the tokens part at index 1
    overlap = spec.startswith("h2o")
    cpu = LLM(path, kv=spec, block_size=16, num_blocks=256, max_num_batched_tokens=48,
              overlap=overlap).generate(prompts, sp)
    llm = LLM(path, kv=spec, block_size=16, num_blocks=256, max_num_batched_tokens=48, device="cuda",
              cuda_graphs=graphs)
    gpu = llm.generate(prompts, sp)
    # decode steps overlap the host's work by default on CUDA, registers included (a queued step masks its own kills)
    assert llm.stats.queued_ahead > 0
    for a, b in zip(cpu, gpu):
        assert a.token_ids == b.token_ids
        assert a.kv_deaths == b.kv_deaths
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-3
        assert (a.kv.peak_visible_tokens, a.kv.mean_visible_tokens) == (b.kv.peak_visible_tokens, b.kv.mean_visible_tokens)
        assert a.kv.peak_blocks <= b.kv.peak_blocks <= a.kv.peak_blocks + 1  # + the last queued step's block


def test_gpu_overlapped_register_kills_match_cpu(register_model):
    """registers with overlap=True on CUDA (graphs, pinned copies): a queued step whose input register kills a step
    masks it in the decode kernel (KILL) inside the captured graph, and the tokens match the CPU path. Catches the
    graph's kills computed once at capture instead of at every replay, or the kernel ignoring them."""
    prompts = [list(range(10, 10 + n)) for n in (3, 17, 40, 5)]
    sp = SamplingParams(max_tokens=100, **GREEDY)
    cpu = LLM(register_model, kv="registers:3", block_size=16, num_blocks=256).generate(prompts, sp)
    llm = LLM(register_model, kv="registers:3", block_size=16, num_blocks=256, device="cuda", overlap=True)
    gpu = llm.generate(prompts, sp)
    assert llm.stats.queued_ahead > 0 and llm.runner.graphs.replays > 0
    for a, b in zip(cpu, gpu):
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-3


def test_gpu_bf16_runs_and_samples_like_cpu_seeded(tiny_model_factory):
    path = tiny_model_factory(arch="llama")
    llm = LLM(path, kv="prefix_sliding:32", device="cuda", dtype="bfloat16", num_blocks=512, max_num_seqs=16)
    outs = llm.generate([[1, 2, 3]] * 16, SamplingParams(max_tokens=200, temperature=0.8, seed=1, ignore_eos=True))
    assert all(len(o.token_ids) == 200 for o in outs)
    assert len({tuple(o.token_ids) for o in outs}) == 1  # same seed, same prompt: same draw in every row
    assert all(torch.isfinite(torch.tensor(o.logprobs)).all() for o in outs)


def test_every_captured_decode_graph_records_the_fused_kernels(tiny_model_factory, monkeypatch):
    # catches: a decode graph captured with grad enabled (``ModelRunner.allocate`` captures the small buckets outside
    # any inference_mode), which records DecoderLM's unfused PyTorch RMSNorm/RoPE path; replaying such a graph gives
    # the same tokens, only ~2 ms per step slower at batch 1 (450 -> 203 tok/s on the H200), so no token test sees it.
    # Independent reference: the fused Triton entry points themselves, counted while each graph is captured.
    import sliderl.kernels.norm_rope as norm_rope
    from sliderl.rollout.decode_graphs import SMALL, DecodeGraphs

    calls = {"rms_norm": 0, "qk_norm_rope": 0}
    for name in calls:
        real = getattr(norm_rope, name)
        monkeypatch.setattr(norm_rope, name, lambda *a, _real=real, _name=name, **k: (
            calls.__setitem__(_name, calls[_name] + 1), _real(*a, **k))[1])
    per_graph: dict[tuple[int, int], dict[str, int]] = {}
    capture = DecodeGraphs._capture

    def counted(self, bucket, splits):
        before = dict(calls)
        out = capture(self, bucket, splits)
        per_graph[(bucket, splits)] = {k: calls[k] - before[k] for k in calls}
        return out

    monkeypatch.setattr(DecodeGraphs, "_capture", counted)
    path = tiny_model_factory(arch="qwen3", hidden_size=128, num_heads=8, num_kv_heads=2, intermediate_size=256)
    llm = LLM(path, kv="prefix_sliding:64", block_size=16, num_blocks=256, device="cuda", dtype="bfloat16",
              max_num_seqs=16)
    llm.generate([list(range(10, 30))] * 12, SamplingParams(max_tokens=40, **GREEDY))  # a lazily captured bucket too
    small = [key for key in per_graph if key[0] <= SMALL]
    assert small and any(key[0] > SMALL for key in per_graph)
    layers = llm.model.config.num_layers
    for key, count in per_graph.items():  # per layer: two norms (+ the final one) and one q/k-norm + RoPE
        assert count["rms_norm"] >= 2 * layers and count["qk_norm_rope"] >= layers, (key, count)


def compiled_ptx(kernel) -> list[str]:
    """PTX of every variant of a Triton kernel compiled so far in this process (Triton 3.x's per-device caches)."""
    caches = getattr(kernel, "device_caches", None)
    assert caches, f"{kernel} has no device_caches: this Triton keeps compiled kernels elsewhere, update the test"
    return [k.asm["ptx"] for cache in caches.values() for k in cache[0].values()]


@pytest.mark.parametrize("spec", ["prefix_sliding:24", "h2o:32", "registers:4"])
def test_the_pdl_chain_decodes_the_tokens_of_plain_launches(tiny_model_factory, monkeypatch, spec):
    # catches: a kernel of the chain reading its predecessor's output before its griddepcontrol wait, or storing
    # before it (a stale x, q, K/V or a split counter shows as other tokens or logprobs: the kernels are otherwise
    # the same code, so the two runs must agree bit for bit); a kernel of the captured step launched outside the
    # chain (every launch while a graph is captured must ask for PDL); the PTX missing the wait or the L2 prefetch.
    # Independent reference: the same engine with pdl off (its kernels are tested against the CPU path above).
    import sliderl.kernels.cache_write as cache_write
    import sliderl.kernels.decode as decode
    import sliderl.kernels.gemv as gemv
    import sliderl.kernels.norm_rope as norm_rope
    from sliderl.rollout.decode_graphs import DecodeGraphs

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs compute capability 9.0 (Hopper)")
    asked: list[bool] = []
    for module in (cache_write, decode, gemv, norm_rope):
        real = module.launch_options
        monkeypatch.setattr(module, "launch_options", lambda pdl, _real=real: (asked.append(pdl), _real(pdl))[1])
    capture, captured = DecodeGraphs._capture, []

    def recording(self, bucket, splits):
        start = len(asked)
        out = capture(self, bucket, splits)
        captured.append(asked[start:])
        return out

    monkeypatch.setattr(DecodeGraphs, "_capture", recording)
    path = tiny_model_factory(arch="qwen3", hidden_size=128, num_heads=8, num_kv_heads=2, intermediate_size=256)
    prompts = [list(range(10, 10 + n)) for n in (3, 17, 40, 64, 5)]
    sp = SamplingParams(max_tokens=120, **GREEDY)
    outs = {}
    for pdl in (False, True):
        captured.clear()
        llm = LLM(path, kv=spec, block_size=16, num_blocks=256, max_num_batched_tokens=48, device="cuda",
                  dtype="bfloat16", gemv=True, pdl=pdl)
        outs[pdl] = llm.generate(prompts, sp)
        llm.close()
        assert captured and all(launches and all(a == pdl for a in launches) for launches in captured), captured
    for a, b in zip(outs[False], outs[True]):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs and a.kv_deaths == b.kv_deaths
    for kernel in (gemv._gemv_kernel, decode._decode_kernel):
        chained = [ptx for ptx in compiled_ptx(kernel) if "griddepcontrol.wait" in ptx]
        assert chained and all("prefetch.global.L2" in ptx for ptx in chained), kernel
    for kernel in (norm_rope._rms_norm_kernel, norm_rope._qk_norm_rope_kernel, cache_write._write_kv_kernel):
        assert any("griddepcontrol.wait" in ptx for ptx in compiled_ptx(kernel)), kernel


@pytest.fixture(scope="module")
def qwen3_1p7b(tmp_path_factory):
    """The Qwen3-1.7B config with random bf16 weights (built on the GPU), saved with the tiny byte tokenizer."""
    from sliderl.core.tiny import make_qwen3_1p7b

    return make_qwen3_1p7b(tmp_path_factory.mktemp("qwen3-1.7b"))


def test_close_frees_device_memory_for_a_second_full_size_engine(qwen3_1p7b):
    # catches: close() leaving the KV pool, the weights, the CUDA graphs (and their memory pool) or the
    # queued step on the device: two pools of 60% of free memory cannot both fit, so the second
    # engine could not even be built, and memory_allocated() would not return to its baseline
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    baseline = torch.cuda.memory_allocated()
    free, _ = torch.cuda.mem_get_info()
    kv_gb = 0.6 * free / 2**30
    prompts = [list(range(100, 100 + n)) for n in (17, 300, 64, 5)]
    sp = SamplingParams(max_tokens=64, **GREEDY)
    outs = []
    for _ in range(2):
        with LLM(str(qwen3_1p7b), kv="prefix_sliding:128", device="cuda", dtype="bfloat16", kv_cache_gb=kv_gb,
                 max_num_seqs=8) as llm:
            assert torch.cuda.memory_allocated() - baseline > 0.6 * free - 2**30  # the pool is there
            outs.append([o.token_ids for o in llm.generate(prompts, sp)])
            assert llm.runner.graphs.graphs and llm.stats.queued_ahead > 0  # graphs captured, a step queued ahead
        torch.cuda.synchronize()
        # what may stay: cuBLAS workspaces (per stream, tens of MiB) and the decode kernel's split counters
        assert torch.cuda.memory_allocated() - baseline < 256 * 2**20
        assert torch.cuda.mem_get_info()[0] > free - 2 * 2**30  # handed back to the driver, not only cached
    assert outs[0] == outs[1]
