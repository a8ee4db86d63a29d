"""How a model directory reaches actors on any node: ``ModelFiles``.

The driver knows a model as a folder on its own disk (``model.path``, a built tiny model) and the
warm start's actor as a folder on *its* node. Neither is on the other nodes. ``ModelFiles`` carries
the folder's path and the node that holds it and, on a cluster of more than one node, the folder's
files in Ray's object store (read once, put once; Ray moves them to the nodes that ask). An actor
calls ``local_path()``: on the folder's own node that is the folder itself; elsewhere the files are
written once per node into ``$TMPDIR/sliderl-models/<sha256 of the files>/`` (staged, then renamed,
so a half-written copy is never used) and that copy is the path.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

COPIES = "sliderl-models"


@dataclass(frozen=True)
class ModelFiles:
    """A model folder as every actor can open it (the driver's: ``ship``; the warm start's: from its actor)."""

    path: str  # the folder, on node ``node_id``
    node_id: str
    digest: str = ""  # sha256 over the files' names and bytes; names the copies on other nodes
    files: Any = None  # ObjectRef of {relative path: bytes}; None when every actor runs on ``node_id``

    @classmethod
    def ship(cls, path: str, multi_node: bool) -> ModelFiles:
        """The folder ``path`` on this process's node; its files go into the object store when ``multi_node``."""
        import ray

        node = ray.get_runtime_context().get_node_id()
        if not multi_node:
            return cls(str(path), node)
        files = read_folder(path)
        return cls(str(path), node, folder_digest(files), ray.put(files))

    def local_path(self) -> str:
        """The folder on this process's node: ``path`` on the node that holds it, else a copy of the files."""
        import ray

        if ray.get_runtime_context().get_node_id() == self.node_id:
            return self.path
        if self.files is None:
            raise RuntimeError(f"the model folder {self.path} is on node {self.node_id}, which is not this node, and "
                               "its files were not shipped (ModelFiles.ship with multi_node=True)")
        copy = Path(tempfile.gettempdir()) / COPIES / self.digest
        if not (copy / "config.json").is_file():
            write_folder(ray.get(self.files), copy)
        return str(copy)


def read_folder(path: str | os.PathLike) -> dict[str, bytes]:
    """Every file under ``path``, by its path relative to it (posix)."""
    root = Path(path)
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def folder_digest(files: dict[str, bytes]) -> str:
    digest = hashlib.sha256()
    for name in sorted(files):
        digest.update(name.encode() + b"\0" + hashlib.sha256(files[name]).digest())
    return digest.hexdigest()


def write_folder(files: dict[str, bytes], path: Path) -> None:
    """Write ``files`` as the folder ``path``: staged beside it, renamed into place (a copy another
    process finished first wins)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.parent / f".{path.name}.writing-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    for name, data in files.items():
        (staging / name).parent.mkdir(parents=True, exist_ok=True)
        (staging / name).write_bytes(data)
    try:
        staging.rename(path)
    except OSError:  # another actor on this node wrote the same copy first
        shutil.rmtree(staging, ignore_errors=True)
        if not (path / "config.json").is_file():
            raise


def local_folder(model: ModelFiles | str) -> str:
    """The folder of ``model`` on this node: ``ModelFiles.local_path()``, or a path given as it is."""
    return model.local_path() if isinstance(model, ModelFiles) else str(model)
