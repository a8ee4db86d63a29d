"""Config loading: YAML + overrides, clear errors, the model sources, and the records the configs compose."""

import dataclasses
from pathlib import Path

import pytest
import yaml

from sliderl.cluster.config.base import GenerateConfig, HFModel, TinyModel, field_docs, load_config, save_config
from sliderl.cluster.errors import ConfigError
from sliderl.rollout.engine_args import EngineArgs
from sliderl.rollout.sampling import SamplingParams

REPO = Path(__file__).resolve().parents[1]


def test_no_file_runs_the_recipe():
    # Catches: `sliderl generate` without a file running the library defaults instead of its recipe.
    cfg = load_config(GenerateConfig, None, [])
    assert cfg == load_config(GenerateConfig, str(REPO / "configs" / "generate-tiny.yaml"), []).model_copy(
        update={"output_dir": cfg.output_dir})
    assert isinstance(cfg.model, TinyModel) and cfg.model.arch == "qwen3"
    assert cfg.engine.kv == "prefix_sliding:64"
    assert (cfg.engine.device, cfg.engine.dtype) == ("cpu", "float32")
    assert cfg.sampling.max_tokens == 256
    assert cfg.output_dir.startswith("runs/generate-")
    assert len(cfg.prompts) >= 1 and cfg.n >= 1


def test_override_values_are_parsed_as_yaml():
    cfg = load_config(GenerateConfig, None, [
        "engine.block_size=32", "sampling.stop=[a, b]", "sampling.temperature=0", "engine.num_blocks=null",
        "prompts=[hi there]", "sampling.ignore_eos=true", "engine.kv=streaming:4:32",
    ])
    assert cfg.engine.block_size == 32
    assert cfg.sampling.stop == ["a", "b"]
    assert cfg.sampling.temperature == 0.0
    assert cfg.engine.num_blocks is None
    assert cfg.prompts == ["hi there"]
    assert cfg.sampling.ignore_eos is True
    assert cfg.engine.kv == "streaming:4:32"


def test_overrides_win_over_the_file_and_the_file_over_defaults(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("engine:\n  block_size: 8\n  kv: full\nsampling:\n  max_tokens: 7\nn: 3\n")
    cfg = load_config(GenerateConfig, str(path), ["engine.block_size=4"])
    assert cfg.engine.block_size == 4  # override
    assert cfg.engine.kv == "full" and cfg.sampling.max_tokens == 7 and cfg.n == 3  # file
    assert cfg.engine.max_num_seqs == 64  # default


def test_kv_spec_is_canonicalised():
    assert EngineArgs(kv=" prefix_sliding:128 ").kv == "prefix_sliding:128"


def test_switching_a_variant_drops_the_other_variants_keys(tmp_path):
    # Catches: `model.type=hf` over a file's tiny model keeping hidden_size etc. (an unknown key for hf).
    path = tmp_path / "job.yaml"
    path.write_text("model:\n  type: tiny\n  hidden_size: 32\n")
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    cfg = load_config(GenerateConfig, str(path), ["model.type=hf", f"model.path={tmp_path / 'm'}"])
    assert isinstance(cfg.model, HFModel)


@pytest.mark.parametrize("override, expected", [
    ("engine.blok_size=3", ["engine", "'blok_size'", "did you mean 'block_size'", "max_num_batched_tokens"]),
    ("sampling.temprature=0.5", ["sampling", "'temprature'", "temperature", "top_p"]),
    ("modle.arch=llama", ["top level", "'modle'", "model", "output_dir"]),
    ("model.hiden=3", ["model", "'hiden'", "hidden_size", "cache_dir"]),
    ("engine.overlaps=true", ["engine", "'overlaps'", "did you mean 'overlap'", "cuda_graphs"]),
])
def test_unknown_key_names_the_key_and_the_valid_ones(override, expected):
    with pytest.raises(ConfigError) as err:
        load_config(GenerateConfig, None, [override])
    for fragment in expected:
        assert fragment in str(err.value)


def test_unknown_key_in_a_file_is_reported(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("engine:\n  kv_cache: 2\n")
    with pytest.raises(ConfigError, match=r"engine: unknown key 'kv_cache'.*kv_cache_gb"):
        load_config(GenerateConfig, str(path), [])


@pytest.mark.parametrize("override", ["engine.block_size", "=3", "engine..kv=full", ".kv=full"])
def test_malformed_override(override):
    with pytest.raises(ConfigError, match="malformed override"):
        load_config(GenerateConfig, None, [override])


@pytest.mark.parametrize("override, expected", [
    ("engine.block_size=0", "engine: block_size must be an integer >= 1, got 0"),
    ("engine.block_size=abc", "engine.block_size: Input should be a valid integer"),
    ("engine.kv=prefix:3", "engine: unknown KV policy 'prefix'"),
    ("engine.kv=prefix_sliding:0", "engine: window must be >= 1"),
    ("engine.device=gpu", "engine: device must be cpu, cuda or cuda:N, got 'gpu'"),
    ("engine.dtype=fp16", "engine: dtype must be one of float32, bfloat16, float16, got 'fp16'"),
    ("engine.kv_cache_gb=0", "engine: kv_cache_gb must be None or a finite number > 0, got 0"),
    ("sampling.top_p=1.5", "sampling: SamplingParams.top_p must be in (0, 1], got 1.5"),
    ("sampling.top_k=0", "sampling: SamplingParams.top_k must be -1 (off) or an integer >= 1, got 0"),
    ("n=0", "n: Input should be greater than or equal to 1"),
    ("prompts=[]", "prompts: List should have at least 1 item"),
    ("model.type=gguf", "model.type must be one of 'tiny', 'hf', got 'gguf'"),
    ("model.type=hf", "model.path: Field required"),
    ("model.num_kv_heads=3", "model: num_kv_heads (3) must divide num_heads (4)"),
    ("engine.block_size.x=1", "engine.block_size holds a value, not a section"),
])
def test_bad_values_name_the_key_and_the_rule(override, expected):
    with pytest.raises(ConfigError) as err:
        load_config(GenerateConfig, None, [override])
    assert expected in str(err.value)
    assert "\n" not in str(err.value)


def test_override_into_a_value_is_an_error(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("n: 2\n")
    with pytest.raises(ConfigError, match="n holds a value, not a section"):
        load_config(GenerateConfig, str(path), ["n.x=1"])


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(GenerateConfig, str(tmp_path / "missing.yaml"), [])
    broken = tmp_path / "broken.yaml"
    broken.write_text("engine: [\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(GenerateConfig, str(broken), [])
    listing = tmp_path / "list.yaml"
    listing.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_config(GenerateConfig, str(listing), [])
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    assert load_config(GenerateConfig, str(empty), []).engine.kv == "full"  # a file replaces the recipe


def test_saved_config_is_complete_and_loads_back(tmp_path):
    cfg = load_config(GenerateConfig, None, ["engine.kv=registers:4", "sampling.stop=[x]", "output_dir=out"])
    save_config(cfg, tmp_path / "sub" / "config.yaml")
    written = yaml.safe_load((tmp_path / "sub" / "config.yaml").read_text())
    # every field of every section is written, defaults included
    assert set(written) == {"model", "engine", "sampling", "prompts", "n", "output_dir"}
    assert written["engine"]["block_size"] == 16 and written["engine"]["kv"] == "registers:4"
    assert written["model"]["type"] == "tiny" and written["sampling"]["stop"] == ["x"]
    assert load_config(GenerateConfig, str(tmp_path / "sub" / "config.yaml"), []) == cfg


def test_every_field_is_documented():
    # Catches: a knob added to a record or section without the docstring --help prints for it.
    for section in (GenerateConfig, HFModel):
        for name, field in section.model_fields.items():
            assert field.description, f"{section.__name__}.{name} has no docstring"
    for record in (EngineArgs, SamplingParams, TinyModel):
        docs = field_docs(record)
        for field in dataclasses.fields(record):
            assert docs.get(field.name), f"{record.__name__}.{field.name} has no docstring"


def test_generate_composes_the_engine_and_sampling_records():
    # Catches: a config section that re-declares the engine's or the sampler's settings (with its own
    # defaults) instead of validating the records themselves.
    cfg = load_config(GenerateConfig, None, ["engine.overlap=false", "engine.cuda_graphs=false"])
    assert type(cfg.engine) is EngineArgs and type(cfg.sampling) is SamplingParams
    assert cfg.engine.overlap is False and cfg.engine.cuda_graphs is False
    assert GenerateConfig.model_fields["engine"].default_factory() == EngineArgs()


def test_sampling_seed_is_offset_per_sample():
    # Catches: the per-sample seed computed differently for generate and for rollout groups.
    params = SamplingParams(seed=10, temperature=0.7, top_k=5, stop=["\n"])
    p0, p3 = params.for_sample(0), params.for_sample(3)
    assert (p0.seed, p3.seed) == (10, 13)
    assert (p3.temperature, p3.top_k, p3.stop) == (0.7, 5, ["\n"])
    assert SamplingParams().for_sample(3).seed is None  # the engine derives per-request seeds
    assert SamplingParams().for_sample(3, base_seed=100).seed == 103  # a rollout group's base seed


def test_tiny_model_is_built_once_in_a_folder_named_by_its_parameters(tmp_path):
    from transformers import AutoConfig

    source = TinyModel(arch="llama", hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                       intermediate_size=48, seed=3, cache_dir=str(tmp_path))
    path = Path(source.resolve())
    assert path == tmp_path / "tiny-llama-h32-l1-q2-kv1-i48-p4096-s3"
    config = AutoConfig.from_pretrained(path)
    assert config.model_type == "llama"
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads,
            config.num_key_value_heads, config.intermediate_size) == (32, 1, 2, 1, 48)
    stamp = (path / "config.json").stat().st_mtime_ns
    assert source.resolve() == str(path)
    assert (path / "config.json").stat().st_mtime_ns == stamp  # not rebuilt
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no staging folder left


def test_hf_model_source(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    cfg = load_config(GenerateConfig, None, ["model.type=hf", f"model.path={tmp_path}"])
    assert isinstance(cfg.model, HFModel)
    assert cfg.model.resolve() == str(tmp_path)
    with pytest.raises(ConfigError, match="is not a Hugging Face model directory"):
        HFModel(path=str(tmp_path / "nowhere")).resolve()


def test_shipped_configs_validate():
    files = sorted((REPO / "configs").glob("generate*.yaml"))
    assert files
    for path in files:
        load_config(GenerateConfig, str(path), [])
