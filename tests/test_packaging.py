"""sliderl installs one top-level import name, so it cannot shadow a library of the same name.

A top-level ``kernels/`` package once shadowed Hugging Face's ``kernels`` (a dependency of
transformers since 5.25): ``python -m pytest`` from the repository root puts the root first on
``sys.path``, and every ``from transformers import ...`` failed inside transformers' hub-kernels
integration.
"""

import os
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_repository_root_holds_one_import_package():
    # Catches: a package added (or moved back) beside sliderl/ at the root, e.g. kernels/ — planted by
    # `git mv sliderl/kernels kernels`, the root's packages are ['kernels', 'sliderl'] and this fails.
    packages = sorted(p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file())
    modules = sorted(p.name for p in ROOT.glob("*.py"))
    assert packages == ["sliderl"] and modules == []


def test_the_distribution_ships_only_packages_under_sliderl():
    # Catches: pyproject listing a package outside sliderl (it would land in site-packages as a top-level
    # name, as "kernels" did), or a sliderl subpackage left out of the wheel. Planted by listing "kernels"
    # in [tool.setuptools] packages, this fails.
    listed = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    on_disk = sorted(".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "sliderl").rglob("__init__.py"))
    assert sorted(listed) == on_disk
    assert all(name == "sliderl" or name.startswith("sliderl.") for name in listed)


def test_transformers_imports_from_the_repository_root():
    # Catches the shadowing itself: run from the root as `python -m pytest` is (the root on sys.path first),
    # transformers' hub-kernels integration and a config class import, and `kernels`, where it is
    # installed, is not a folder of this repository. Planted by `git mv sliderl/kernels kernels` with
    # transformers 5.25, this fails with "cannot import name 'CUDAProperties' from 'kernels'".
    code = ("import importlib.util, transformers.integrations.hub_kernels\n"
            "from transformers import Qwen3Config\n"
            "spec = importlib.util.find_spec('kernels')\n"
            "print(spec.origin if spec else '')\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    origin = done.stdout.strip()
    assert not origin or "site-packages" in Path(origin).parts, origin
