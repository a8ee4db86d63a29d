"""The sampler against exact float64 distributions, a pure-Python copy of the documented hash, and argmax."""

import numpy as np
import pytest
import torch

from sliderl.core.logprob import logprobs_at
from sliderl.rollout.sampling import SamplingParams, sample, uniform_noise

# Tiny vocabulary, deliberately unsorted so the sampler's sort must map ranks back to token ids.
LOGITS6 = np.array([0.5, -1.0, 2.0, -3.0, 1.0, 0.0])

# Chi-square critical values at alpha = 0.001 by degrees of freedom (standard table).
CHI2_CRIT_001 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515}

N_DRAWS = 24_000  # per case: 6 seeds x 4000 steps

# (temperature, top_p, top_k). The reference sizes of the kept sets are in the comments
# (probabilities sorted, from float64 softmax of LOGITS6 / T):
CASES = {
    "t1": (1.0, 1.0, -1),  # all 6 tokens
    "t0.7": (0.7, 1.0, -1),  # all 6; smallest p = 0.0006 -> expected count 14
    "t1.5_k3": (1.5, 1.0, 3),  # 3 tokens
    "t1_p0.85": (1.0, 0.85, -1),  # cum 0.561, 0.767, 0.892 -> 3 tokens
    # top-k=4 renormalised cum 0.657, 0.845, 0.946 -> 3 tokens; top-p on the un-renormalised
    # distribution (cum 0.646, 0.831, 0.931) would keep 4, so this case checks the order.
    "t0.8_k4_p0.94": (0.8, 0.94, 4),
    "p0.3": (1.0, 0.3, -1),  # first prob 0.561 >= 0.3 -> only the argmax (token 2)
}


def exact_distribution(logits: np.ndarray, temperature: float, top_p: float, top_k: int) -> np.ndarray:
    """Float64 reference: softmax(l / T), keep top k, renormalise, keep smallest prefix with mass >= top_p."""
    z = logits / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    order = sorted(range(len(p)), key=lambda i: -p[i])
    if top_k > 0:
        order = order[:top_k]
    q = np.zeros_like(p)
    q[order] = p[order]
    q /= q.sum()
    kept, mass = [], 0.0
    for i in order:
        kept.append(i)
        mass += q[i]
        if mass >= top_p:
            break
    out = np.zeros_like(p)
    out[kept] = q[kept]
    return out / out.sum()


def batch_rows(case_names):
    """One row per draw: LOGITS6 repeated, each case's params, seeds 0..5 x steps 0..3999."""
    rows = len(case_names) * N_DRAWS
    draw = torch.arange(N_DRAWS)
    params = torch.tensor([CASES[n] for n in case_names], dtype=torch.float64).repeat_interleave(N_DRAWS, 0)
    return dict(
        logits=torch.tensor(LOGITS6, dtype=torch.float32).expand(rows, 6).contiguous(),
        temperature=params[:, 0].float(),
        top_p=params[:, 1].float(),
        top_k=params[:, 2].long(),
        seed=(draw // 4000).repeat(len(case_names)),
        step=(draw % 4000).repeat(len(case_names)),
    )


@pytest.mark.parametrize("case_names", [
    ["t1", "t0.7"],  # no row truncates: the no-sort path
    list(CASES),  # every case in one batch: the sorting path, rows with top_p=1/top_k=-1 included
], ids=["fast_path", "mixed_batch"])
def test_empirical_distribution_matches_exact(case_names):
    tokens, _ = sample(**batch_rows(case_names))
    for c, name in enumerate(case_names):
        expected = exact_distribution(LOGITS6, *CASES[name])
        counts = np.bincount(tokens[c * N_DRAWS:(c + 1) * N_DRAWS].numpy(), minlength=6)
        allowed = expected > 0
        assert counts[~allowed].sum() == 0, f"{name}: disallowed tokens drawn, counts {counts}"
        df = int(allowed.sum()) - 1
        if df == 0:
            continue  # single allowed token: the zero-count check above is the whole test
        exp_counts = expected[allowed] * N_DRAWS
        chi2 = float(((counts[allowed] - exp_counts) ** 2 / exp_counts).sum())
        assert chi2 < CHI2_CRIT_001[df], f"{name}: chi2 {chi2:.2f} >= {CHI2_CRIT_001[df]} (df {df}), counts {counts}"


def _mix32_py(x: int) -> int:
    """lowbias32 on Python ints, written from the module docstring."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def _uniform_py(seed: int, step: int, v: int) -> float:
    seed_lo, seed_hi = seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF
    key_a = _mix32_py(_mix32_py(_mix32_py(seed_hi ^ 0x2545F491) ^ seed_lo) ^ (step & 0xFFFFFFFF))
    key_b = _mix32_py(key_a ^ 0x9E3779B9)
    h = _mix32_py(_mix32_py(v ^ key_a) ^ key_b)
    return (2 * (h >> 9) + 1) / 2**24


def test_noise_matches_documented_hash_on_python_ints():
    seeds = [0, 1, -1, 2**40 + 7, 2**63 - 1, -(2**63)]
    steps = [0, 1, 2**31 + 5, 123_456, 7, 2**32 + 3]
    vocab = 151_936
    u = uniform_noise(torch.tensor(seeds), torch.tensor(steps), vocab)
    for r, (seed, step) in enumerate(zip(seeds, steps)):
        for v in (0, 1, 2, 65_535, 65_536, vocab - 1):
            assert u[r, v].item() == _uniform_py(seed, step, v)
    assert 0.0 < u.min().item() and u.max().item() < 1.0
    assert abs(u.mean().item() - 0.5) < 1e-3  # 911k uniforms: std of the mean is 0.0003


def test_same_seed_and_step_give_same_token_in_any_batch():
    gen = torch.Generator().manual_seed(0)
    v = 1000
    logits = torch.randn(8, v, generator=gen) * 3
    temperature = torch.tensor([1.0, 0.7, 1.3, 0.0, 1.0, 0.9, 1.0, 0.5])
    top_p = torch.tensor([1.0, 0.9, 1.0, 1.0, 0.5, 0.95, 1.0, 1.0])
    top_k = torch.tensor([-1, -1, 50, -1, -1, 20, 3, -1])
    seed = torch.tensor([0, 1, 2, 3, 4, 5, 6, 2**40])
    step = torch.tensor([0, 5, 17, 2, 900, 3, 1, 44])
    alone = [sample(logits[i:i + 1], temperature[i:i + 1], top_p[i:i + 1], top_k[i:i + 1],
                    seed[i:i + 1], step[i:i + 1])[0].item() for i in range(8)]
    together, _ = sample(logits, temperature, top_p, top_k, seed, step)
    assert together.tolist() == alone
    # Reversed and interleaved with 8 other requests (different seeds, steps and params).
    perm = torch.arange(7, -1, -1)
    mixed = lambda a, b: torch.stack([a[perm], b], dim=1).reshape(16, *a.shape[1:])
    others = dict(logits=torch.randn(8, v, generator=gen), temperature=torch.full((8,), 1.0),
                  top_p=torch.full((8,), 0.8), top_k=torch.full((8,), 10), seed=torch.arange(100, 108),
                  step=torch.arange(8) * 11)
    shuffled, _ = sample(mixed(logits, others["logits"]), mixed(temperature, others["temperature"]),
                         mixed(top_p, others["top_p"]), mixed(top_k, others["top_k"]),
                         mixed(seed, others["seed"]), mixed(step, others["step"]))
    assert shuffled[0::2].tolist() == [alone[i] for i in perm.tolist()]


def test_different_seeds_and_steps_draw_differently():
    v, n = 1000, 256
    flat = dict(logits=torch.zeros(n, v), temperature=torch.ones(n), top_p=torch.ones(n),
                top_k=torch.full((n,), -1))
    by_seed, _ = sample(**flat, seed=torch.arange(n), step=torch.zeros(n, dtype=torch.long))
    by_step, _ = sample(**flat, seed=torch.zeros(n, dtype=torch.long), step=torch.arange(n))
    other_seed, _ = sample(**flat, seed=torch.ones(n, dtype=torch.long), step=torch.arange(n))
    # 256 uniform draws over 1000 tokens: ~226 distinct expected (1000 * (1 - (1 - 1/1000)**256)).
    assert len(set(by_seed.tolist())) > 200
    assert len(set(by_step.tolist())) > 200
    assert (by_step != other_seed).sum().item() > 250  # P(equal) = 1/1000 per step


def _log_softmax64(logits: np.ndarray) -> np.ndarray:
    z = logits - logits.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def test_greedy_is_argmax_and_logprobs_match_float64():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(16, 50, generator=gen) * 4
    x = logits.double().numpy()
    tokens, logprobs = sample(logits, torch.zeros(16), torch.full((16,), 0.5), torch.full((16,), 3),
                              torch.arange(16), torch.zeros(16, dtype=torch.long))
    assert tokens.tolist() == x.argmax(axis=1).tolist()
    expected = _log_softmax64(x)[np.arange(16), tokens.numpy()]
    np.testing.assert_allclose(logprobs.numpy(), expected, rtol=0, atol=1e-5)


def test_sampled_logprob_is_before_truncation():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(32, 200, generator=gen) * 3
    temperature = torch.tensor([0.7, 1.0, 1.4, 0.0] * 8)
    tokens, logprobs = sample(logits, temperature, torch.full((32,), 0.9), torch.full((32,), 5),
                              torch.arange(32), torch.full((32,), 7))
    greedy = temperature == 0  # greedy rows share the batch with sampled ones: still the argmax
    assert tokens[greedy].tolist() == logits[greedy].double().numpy().argmax(axis=1).tolist()
    t = temperature.double().numpy()
    t[t == 0] = 1.0  # greedy rows: unscaled log-softmax
    expected = _log_softmax64(logits.double().numpy() / t[:, None])[np.arange(32), tokens.numpy()]
    np.testing.assert_allclose(logprobs.numpy(), expected, rtol=0, atol=1e-5)
    # Forced tokens (not the sampled ones) through logprobs_at: same convention.
    forced = torch.arange(32) * 6 % 200
    expected = _log_softmax64(logits.double().numpy() / t[:, None])[np.arange(32), forced.numpy()]
    np.testing.assert_allclose(logprobs_at(logits, forced, temperature).numpy(), expected, rtol=0, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cpu_and_cuda_draw_the_same_tokens():
    rows = batch_rows(list(CASES))
    cpu, _ = sample(**rows)
    cuda, _ = sample(**{k: t.cuda() for k, t in rows.items()})
    assert torch.equal(cpu, cuda.cpu())
    # rows without top-k/top-p take the fused kernel on CUDA (kernels.sample): same tokens at a
    # Qwen3-size vocabulary (near-ties apart, which random logits do not produce)
    gen = torch.Generator().manual_seed(1)
    b, v = 64, 151936
    logits = torch.randn(b, v, generator=gen) * 2
    temperature = torch.rand(b, generator=gen) + 0.25
    temperature[::8] = 0.0
    seed, step = torch.randint(-2**62, 2**62, (b,), generator=gen), torch.randint(0, 2**20, (b,), generator=gen)
    args = (temperature, torch.ones(b), torch.full((b,), -1, dtype=torch.long), seed, step)
    cpu_tokens, cpu_logprobs = sample(logits, *args)
    cuda_tokens, cuda_logprobs = sample(logits.cuda(), *(a.cuda() for a in args))
    assert torch.equal(cpu_tokens, cuda_tokens.cpu())
    assert torch.allclose(cpu_logprobs, cuda_logprobs.cpu(), rtol=0, atol=1e-4)


def test_sampling_params_public_api_and_normalisation():
    p = SamplingParams(max_tokens=256, temperature=0.6, top_p=0.95, top_k=-1, seed=0, stop=None, ignore_eos=False)
    assert (p.stop, p.stop_token_ids, p.greedy) == ([], [], False)
    assert SamplingParams(stop="\n\n", stop_token_ids=(7,)).stop == ["\n\n"]
    assert SamplingParams(temperature=0).greedy


@pytest.mark.parametrize("kwargs, name", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(temperature=-0.1), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=0), "top_k"),
    (dict(top_k=-2), "top_k"),
    (dict(max_thinking_tokens=0), "max_thinking_tokens"),
    (dict(seed=2**63), "seed"),
    (dict(stop=[""]), "stop"),
])
def test_sampling_params_rejects_bad_values(kwargs, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kwargs)


def test_fused_kernel_draws_the_torch_samplers_tokens_and_logprobs():
    # Catches a fused CUDA sampler (kernels.sample, used whenever no row truncates) that drifts from
    # the documented sampler: a hash computed differently, key_a and key_b swapped, the
    # tail block of the vocabulary read unmasked, a greedy row sampled, the logprob normalised over a
    # block instead of the row, or a later block's tie winning. Runs the Triton kernel in the CPU
    # interpreter against ``sample``'s torch path on the same rows. Planted: swapping the keys
    # changes most tokens; reading the tail block unmasked changes the logprobs; `ms >= top` lets
    # the later index win the greedy tie row.
    import os

    os.environ.setdefault("TRITON_INTERPRET", "1")
    from sliderl.kernels.sample import fused_sample

    gen = torch.Generator().manual_seed(0)
    b, v = 8, 1000  # 1000 = 3 full blocks of 256 + a masked tail block in the interpreter
    logits = torch.randn(b, v, generator=gen) * 3
    logits[7] = 0.0
    logits[7, [5, 700]] = 9.0  # an exact tie across blocks: torch.argmax (greedy) takes index 5
    temperature = torch.tensor([1.0, 0.0, 0.5, 1.7, 1.0, 1.0, 0.3, 0.0])
    seed = torch.tensor([0, 1, -7, 2**62 + 5, 123456789, -(2**63), 42, 3])
    step = torch.tensor([0, 5, 9, 1, 2**33 + 4, 17, 3, 8])
    ones, off = torch.ones(b), torch.full((b,), -1, dtype=torch.long)
    want_tokens, want_logprobs = sample(logits, temperature, ones, off, seed, step)
    tokens, logprobs = fused_sample(logits, temperature, seed, step)
    assert tokens.tolist() == want_tokens.tolist()
    assert torch.allclose(logprobs, want_logprobs, rtol=0, atol=1e-5), (logprobs, want_logprobs)
    assert tokens[7] == 5


def test_the_runner_hands_each_row_its_own_parameters(tiny_model_factory):
    # ModelRunner.sample packs the rows' parameters into two host-to-device copies and takes greedy batches
    # straight to argmax. Independent reference: sample() on per-row tensors built here, one per parameter.
    # Catches: a pack that hands a row another row's seed, step or top-k (planted: seed and step swapped in the
    # int pack), temperature and top_p swapped, the greedy shortcut's tokens or logprobs differing from sample()'s
    # greedy rows, and a forced row sampled instead of taking its token.
    from types import SimpleNamespace

    from sliderl.rollout import LLM

    runner = LLM(tiny_model_factory("qwen3")).runner
    logits = torch.randn(4, 64, generator=torch.Generator().manual_seed(3)) * 3
    rows = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, top_p=0.9),
            SamplingParams(temperature=1.3, top_k=5), SamplingParams(temperature=1.0)]
    seeds, steps = [11, 22, 33, 44], [5, 0, 7, 2]

    def seqs(params):
        return [SimpleNamespace(params=p, seed=s, num_output=n, request_id=i, thread_index=0, tokens_taken=0)
                for i, (p, s, n) in enumerate(zip(params, seeds, steps))]

    def expected(params):
        col = lambda values, dtype: torch.tensor(values, dtype=dtype)  # noqa: E731
        return sample(logits, col([p.temperature for p in params], torch.float32),
                      col([p.top_p for p in params], torch.float32), col([p.top_k for p in params], torch.int64),
                      col(seeds, torch.int64), col(steps, torch.int64))

    greedy = [SamplingParams(temperature=0.0)] * 4
    for params in (greedy, rows):
        tokens, logprobs = runner.sample(seqs(params), logits)
        ref_tokens, ref_logprobs = expected(params)
        assert torch.equal(tokens, ref_tokens) and torch.equal(logprobs, ref_logprobs), params
    # greedy against float64 by hand (sample() shares the runner's greedy function, so it is no reference there)
    tokens, logprobs = runner.sample(seqs(greedy), logits)
    exact = torch.log_softmax(logits.double(), dim=-1)
    assert torch.equal(tokens, exact.argmax(dim=-1))
    assert torch.allclose(logprobs.double(), exact.gather(1, tokens[:, None]).squeeze(1), atol=1e-5)
    runner.forced.scripts = {2: {0: [9]}}  # request 2 takes token 9 (LLM.force's record)
    tokens, logprobs = runner.sample(seqs(rows), logits)
    temperature = torch.tensor([p.temperature for p in rows])
    assert tokens[2] == 9 and logprobs[2] == logprobs_at(logits[2:3], torch.tensor([9]), temperature[2:3])[0]
    keep = [0, 1, 3]
    assert torch.equal(tokens[keep], expected(rows)[0][keep])
