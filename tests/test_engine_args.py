"""``EngineArgs``: the engine's one settings record — defaults, validation, and ``LLM``'s keywords building it."""

from __future__ import annotations

import dataclasses

import pytest

from sliderl.core.restart import SummaryTool
from sliderl.rollout import LLM, EngineArgs

# LLM's library defaults as docs/guide.md's "Python API" section spells them out
README_DEFAULTS = dict(kv="full", device="cpu", dtype="float32", block_size=16, num_blocks=None, kv_cache_gb=None,
                       max_num_seqs=64, max_num_batched_tokens=1024, kv_watermark=0.01, max_model_len=None, seed=0,
                       cuda_graphs=True, overlap=None, gemv=False, pdl=False, pasta_max_forks=8, pd_steps_ratio=1.0,
                       pd_confidence=None, pd_order="entropy", summary_tool=dataclasses.asdict(SummaryTool()))


def test_defaults_are_the_documented_ones():
    # catches: a default changed in the record (it is declared nowhere else)
    assert dataclasses.asdict(EngineArgs()) == README_DEFAULTS


@pytest.mark.parametrize("field, value, message", [
    # each row catches the check for that value being dropped or loosened in EngineArgs.__post_init__
    ("kv", "lru:4", "unknown KV policy 'lru'"),
    ("kv", "prefix_sliding:0", "window must be >= 1, got 0"),
    ("device", "gpu", "device must be cpu, cuda or cuda:N, got 'gpu'"),
    ("device", "cuda:x", "device must be cpu, cuda or cuda:N, got 'cuda:x'"),
    ("dtype", "float64", "dtype must be one of float32, bfloat16, float16, got 'float64'"),
    ("block_size", 0, "block_size must be an integer >= 1, got 0"),
    ("block_size", "16", "block_size must be an integer >= 1, got '16'"),
    ("max_num_seqs", 0, "max_num_seqs must be an integer >= 1, got 0"),
    ("max_num_batched_tokens", -3, "max_num_batched_tokens must be an integer >= 1, got -3"),
    ("num_blocks", 0, "num_blocks must be None or an integer >= 1, got 0"),
    ("max_model_len", 0, "max_model_len must be None or an integer >= 1, got 0"),
    ("kv_cache_gb", 0, "kv_cache_gb must be None or a finite number > 0, got 0"),
    ("kv_cache_gb", -1.5, "kv_cache_gb must be None or a finite number > 0, got -1.5"),
    ("kv_watermark", 1.0, "kv_watermark must be a fraction of the KV pool, 0 <= x < 1, got 1.0"),
    ("kv_watermark", -0.1, "kv_watermark must be a fraction of the KV pool, 0 <= x < 1, got -0.1"),
    ("seed", 1.5, "seed must be an integer, got 1.5"),
    ("cuda_graphs", "no", "cuda_graphs must be true or false, got 'no'"),
    ("gemv", "yes", "gemv must be true or false, got 'yes'"),
    ("pdl", 1, "pdl must be true or false, got 1"),
    ("pdl", True, "pdl needs a CUDA device of compute capability 9.0 or later (Hopper), got device='cpu'"),
    ("overlap", 1, "overlap must be None, true or false, got 1"),
    ("pasta_max_forks", -1, "pasta_max_forks must be an integer >= 0, got -1"),
    ("pasta_max_forks", 2.0, "pasta_max_forks must be an integer >= 0, got 2.0"),
    ("pd_steps_ratio", 0, "pd_steps_ratio must be in (0, 1] (denoising steps per span token), got 0"),
    ("pd_steps_ratio", 1.5, "pd_steps_ratio must be in (0, 1] (denoising steps per span token), got 1.5"),
    ("pd_confidence", 0.0, "pd_confidence must be None or in (0, 1], got 0.0"),
    ("pd_order", "random", "pd_order must be entropy or uniform, got 'random'"),
])
def test_bad_values_name_the_value_and_what_is_valid(field, value, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        EngineArgs(**{field: value})


def test_pasta_takes_overlap_and_no_forks():
    # catches: pasta refusing overlap (its run-ahead is tested in test_pasta_runtime) or a fork limit of 0
    assert EngineArgs(kv="pasta", overlap=True).overlap is True
    assert EngineArgs(kv="pasta", overlap=False, pasta_max_forks=0).pasta_max_forks == 0


def test_valid_edge_values_are_accepted_and_kv_is_canonical():
    # catches: a bound that is off by one (>= 1 written as > 1) or a kv spec stored as typed
    args = EngineArgs(kv=" prefix_sliding:08 ", device="cuda:1", dtype="float16", block_size=1, num_blocks=1,
                      kv_cache_gb=0.001, max_num_seqs=1, max_num_batched_tokens=1, max_model_len=1, overlap=False,
                      kv_watermark=0)
    assert args.kv == "prefix_sliding:8" and args.device == "cuda:1"
    assert EngineArgs(kv="streaming:0:4").kv == "streaming:0:4"


def test_record_is_frozen():
    # catches: a mutable record, whose checks a later assignment would bypass
    with pytest.raises(dataclasses.FrozenInstanceError):
        EngineArgs().block_size = 0


def test_llm_keywords_build_the_record(tiny_model_factory):
    # catches: LLM keeping its own defaults or dropping/renaming a keyword on the way to the record
    path = tiny_model_factory(arch="qwen3")
    kw = dict(kv="prefix_sliding:8", block_size=4, num_blocks=32, max_num_seqs=3, max_num_batched_tokens=17,
              max_model_len=100, seed=5, overlap=True, cuda_graphs=False)
    llm = LLM(path, **kw)
    assert llm.args == EngineArgs(**kw)
    assert (llm.block_size, llm.max_model_len, llm.scheduler.max_num_seqs) == (4, 100, 3)
    assert llm.scheduler.blocks.num_blocks == 32 and llm.run_ahead.enabled
    assert LLM(path).args == EngineArgs()  # nothing given: the record's defaults
    assert LLM(path, "prefix_sliding:8", num_blocks=32).args == EngineArgs(kv="prefix_sliding:8", num_blocks=32)
    ready = EngineArgs(kv="sliding_window:4", num_blocks=16)
    assert LLM(path, args=ready).args == ready
    assert LLM(path, args=ready, seed=9).args == dataclasses.replace(ready, seed=9)  # keywords replace its fields


def test_unknown_keyword_names_itself_and_the_valid_ones(tmp_path):
    # catches: a typo silently ignored (or surfacing as an unrelated error); checked before any model is read
    with pytest.raises(TypeError, match=r"unknown engine argument\(s\) blocksize; valid: kv, device, dtype, block_size"):
        LLM(tmp_path / "no-model-here", blocksize=32)


def test_bad_value_through_llm_is_the_records_error(tmp_path):
    # catches: LLM validating differently from the record (or loading the model before checking)
    with pytest.raises(ValueError, match="max_num_seqs must be an integer >= 1, got 0"):
        LLM(tmp_path / "no-model-here", max_num_seqs=0)


def test_pydantic_validates_the_record_with_field_docs():
    # catches: a field without its one-line docstring, or extra keys accepted by the job config
    pydantic = pytest.importorskip("pydantic")
    adapter = pydantic.TypeAdapter(EngineArgs)
    assert adapter.validate_python({"kv": "registers:4", "block_size": 8}) == EngineArgs(kv="registers:4", block_size=8)
    with pytest.raises(pydantic.ValidationError, match="blocksize"):
        adapter.validate_python({"blocksize": 8})
    with pytest.raises(pydantic.ValidationError, match="block_size must be an integer >= 1, got 0"):
        adapter.validate_python({"block_size": 0})
    props = adapter.json_schema()["properties"]
    assert set(props) == set(README_DEFAULTS)
    for name, prop in props.items():
        assert prop.get("description") and "\n" not in prop["description"], name
