"""sliderl installs one top-level import name, so it cannot shadow a library of the same name.

A top-level ``kernels/`` package once shadowed Hugging Face's ``kernels`` (a dependency of
transformers since 5.25): ``python -m pytest`` from the repository root puts the root first on
``sys.path``, and every ``from transformers import ...`` failed inside transformers' hub-kernels
integration.
"""

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_repository_root_holds_one_import_package():
    # Catches: a package added (or moved back) beside sliderl/ at the root, e.g. kernels/ — planted by
    # `git mv sliderl/kernels kernels`, the root's packages are ['kernels', 'sliderl'] and this fails.
    packages = sorted(p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file())
    modules = sorted(p.name for p in ROOT.glob("*.py"))
    assert packages == ["sliderl"] and modules == []


def test_the_wheel_holds_sliderl_and_every_package_under_it(tmp_path):
    # Catches: a wheel that puts another top-level name into site-packages (as "kernels" did), and a
    # subpackage of sliderl left out of it. Built by pip as a user's install is, then read as a zip. Planted:
    # pyproject's find include = ["*"] ships benchmarks and tests beside sliderl, include = ["sliderl"] leaves
    # sliderl/kernels out; both fail.
    source = tmp_path / "source"  # a copy: setuptools reuses an in-tree build/, stale files and all
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".git", ".venv", "build", "runs", "*.egg-info", "__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", str(source),
                    "--wheel-dir", str(tmp_path)], check=True, capture_output=True, timeout=300)
    (wheel,) = tmp_path.glob("sliderl-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"sliderl", wheel.name.split("-py")[0] + ".dist-info"}
    packages = sorted(p.parent.relative_to(ROOT).as_posix() for p in (ROOT / "sliderl").rglob("__init__.py"))
    assert [p for p in packages if f"{p}/__init__.py" not in names] == []
    # and the default job's bundled warm start (package data, not a package): catches pyproject's package-data
    # dropped, which leaves a non-editable install training the warm start at every first run (planted: it fails)
    assets = (ROOT / "sliderl" / "assets").rglob("*")
    bundled = sorted(p.relative_to(ROOT).as_posix() for p in assets if p.is_file())
    assert any(p.endswith("model.safetensors") for p in bundled) and [p for p in bundled if p not in names] == []


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
