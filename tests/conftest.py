"""Test setup: offline Hugging Face, Triton's interpreter on CPU, markers, and cached tiny models."""

import os
import sys
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402  (torch does not import triton; kernels modules do, later)

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `pytest` without an installed package still imports sliderl/
    sys.path.insert(0, str(ROOT))


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one)")
    config.addinivalue_line("markers", "slow: takes more than a few seconds")


_exit_status: int | None = None


def pytest_sessionfinish(session, exitstatus):
    global _exit_status
    _exit_status = int(exitstatus)


@pytest.hookimpl(tryfirst=True)
def pytest_unconfigure(config):
    """Leave without the interpreter's teardown, with the session's exit status: that teardown crashed once
    (SIGSEGV after "807 passed", one full run in four on 2026-12-05; a rerun under faulthandler did not, so the
    extension whose threads outlived the tests is not known), which CI reads as a failed run. Ray is shut down
    first if a test left it up. First of the unconfigure hooks (the summary is printed by then): pytest's own
    collects garbage until none is left, which after the GPU tests outlasted a device item's limit (33 passed in
    145 s, then killed at 150 s inside that collection, 2026-12-05)."""
    if _exit_status is None or hasattr(config, "workerinput"):  # an xdist worker leaves as xdist has it leave
        return
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_exit_status)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory):
    """``make(arch="qwen3", **kw) -> Path``: a tiny HF model dir from ``core.tiny.make_tiny_model``,
    built once per distinct (arch, kw) in the session and shared between tests. Treat it as read-only."""
    from sliderl.core.tiny import make_tiny_model

    root = tmp_path_factory.mktemp("tiny_models")
    built: dict[str, Path] = {}

    def make(arch: str = "qwen3", **kw) -> Path:
        key = f"{arch}:{sorted(kw.items(), key=lambda item: item[0])!r}"
        if key not in built:
            built[key] = make_tiny_model(root / f"{arch}-{len(built)}", arch, **kw)
        return built[key]

    return make


def boosted_token_model(directory: Path, tokens: tuple[str, ...]) -> Path:
    """A tiny untied Qwen3 with ``tokens`` added as special tokens (the last rows of its vocabulary), their lm_head
    rows scaled to twice the head's spread (seeded) so greedy decoding emits them now and then."""
    from safetensors.torch import load_file, save_file

    from sliderl.core.tiny import make_tiny_model

    path = make_tiny_model(directory, "qwen3", tie_word_embeddings=False, extra_special_tokens=tuple(tokens))
    weights = load_file(path / "model.safetensors")
    head = weights["lm_head.weight"].clone()
    n = len(tokens)
    head[-n:] = torch.randn(n, head.shape[1], generator=torch.Generator().manual_seed(1)) * head.std() * 2.0
    weights["lm_head.weight"] = head
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


@pytest.fixture(scope="session")
def register_model(tmp_path_factory):
    """A tiny untied Qwen3 with ``<reg_0..2>`` whose lm_head rows are boosted so greedy decoding emits
    registers often (about one token in five), giving steps that are killed and evicted."""
    from sliderl.core.kv_policy import register_tokens

    return boosted_token_model(tmp_path_factory.mktemp("reg") / "m", tuple(register_tokens(3)))
