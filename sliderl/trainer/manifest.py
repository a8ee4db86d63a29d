"""Checkpoint manifests: every file of a checkpoint folder with its size and sha256, and the check of
a folder against its manifest.

The big files are hashed while they are written (``HashingWriter``: ``torch.save`` and the
safetensors writer write through it), so saving a multi-GB checkpoint costs no second read; small
files are hashed after writing (``hash_file``). Checking a folder (``Manifest.damage``) reads every
listed file once more, so it belongs where a checkpoint is about to be trusted (a resume, a learner
restart), not after every save.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

MANIFEST = "manifest.json"
FORMAT = 1  # the manifest's own layout version
_SHA256 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class FileEntry:
    """One file of a checkpoint: its size in bytes and the hex sha256 of its content."""

    size: int
    sha256: str


class HashingWriter:
    """A binary file open for writing that keeps the size and sha256 of everything written to it.

    ``write`` takes any contiguous buffer (bytes, a NumPy array). Closing flushes and fsyncs the file;
    ``entry()`` is then its ``FileEntry``.
    """

    def __init__(self, path: str | os.PathLike):
        self._file = open(path, "wb")
        self._sha256 = hashlib.sha256()
        self.size = 0

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        self._file.write(view)
        self._sha256.update(view)
        self.size += len(view)
        return len(view)

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        if not self._file.closed:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()

    def entry(self) -> FileEntry:
        assert self._file.closed, "a file's entry is known once it is closed"
        return FileEntry(self.size, self._sha256.hexdigest())

    def __enter__(self) -> HashingWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def write_file(path: str | os.PathLike, data: bytes) -> FileEntry:
    """Write ``data`` to ``path`` (fsync'd) and return its entry."""
    with HashingWriter(path) as out:
        out.write(data)
    return out.entry()


def hash_file(path: str | os.PathLike) -> FileEntry:
    """The entry of an existing file, read once."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        return FileEntry(size, hashlib.file_digest(f, "sha256").hexdigest())


@dataclass
class Manifest:
    """The files of a checkpoint folder (plain names inside it) with their sizes and checksums.

    The manifest itself and a run checkpoint's ``COMPLETE`` marker are not listed.
    """

    files: dict[str, FileEntry] = field(default_factory=dict)

    def add(self, name: str, entry: FileEntry) -> None:
        self.files[name] = entry

    def to_json(self) -> str:
        files = {name: {"size": e.size, "sha256": e.sha256} for name, e in sorted(self.files.items())}
        return json.dumps({"format": FORMAT, "files": files}, indent=1) + "\n"

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        """Reads what ``to_json`` writes; anything else raises ValueError saying what is wrong."""
        data = json.loads(text)
        if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("files"), dict):
            raise ValueError(f'expected {{"format": {FORMAT}, "files": {{name: {{"size", "sha256"}}}}}}')
        return cls({name: _entry(name, e) for name, e in data["files"].items()})

    def write(self, folder: str | os.PathLike) -> None:
        """Write ``folder/manifest.json``, fsync'd, replacing any earlier one in one step."""
        tmp = Path(folder) / (MANIFEST + ".tmp")
        write_file(tmp, self.to_json().encode())
        os.replace(tmp, Path(folder) / MANIFEST)

    @classmethod
    def read(cls, folder: str | os.PathLike) -> Manifest | None:
        """The manifest of ``folder``, or None when it has none; an unreadable or invalid one raises
        ValueError naming the file and the problem."""
        path = Path(folder) / MANIFEST
        if not path.exists():
            return None
        try:
            return cls.from_json(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as err:  # json's decode errors are ValueErrors
            raise ValueError(f"{path} is not a valid manifest: {err}") from None

    def damage(self, folder: str | os.PathLike) -> str | None:
        """What is wrong with ``folder``, naming the file's path; None when every listed file is there with
        its size and sha256. Sizes are compared first (a stat each), then each file is read once to hash it."""
        paths = {Path(folder) / name: entry for name, entry in self.files.items()}
        for path, entry in paths.items():
            if not path.is_file():
                return f"{path} is missing"
            size = path.stat().st_size
            if size != entry.size:
                return f"{path} has {size} bytes where the manifest says {entry.size}"
        for path, entry in paths.items():
            try:
                digest = hash_file(path).sha256
            except OSError as err:
                return f"{path} cannot be read ({err.strerror or err})"
            if digest != entry.sha256:
                return f"{path} does not match its sha256 in the manifest (its content changed)"
        return None


def _entry(name: str, value) -> FileEntry:
    if not isinstance(name, str) or name in ("", ".", "..") or Path(name).name != name:
        raise ValueError(f"file name {name!r} is not a plain name inside the folder")
    valid = (isinstance(value, dict) and set(value) == {"size", "sha256"} and type(value["size"]) is int
             and value["size"] >= 0 and isinstance(value["sha256"], str) and _SHA256.fullmatch(value["sha256"]))
    if not valid:
        raise ValueError(f'the entry of {name!r} is not {{"size": bytes, "sha256": 64 hex digits}}: {value!r}')
    return FileEntry(value["size"], value["sha256"])


def check_intact(folder: str | os.PathLike) -> None:
    """Raise ValueError naming the file when ``folder`` does not match its manifest (a checkpoint written
    before manifests, without one, passes: there is nothing to compare with)."""
    manifest = Manifest.read(folder)
    problem = manifest.damage(folder) if manifest is not None else None
    if problem is not None:
        raise ValueError(f"checkpoint {str(folder)!r} is damaged: {problem}")

