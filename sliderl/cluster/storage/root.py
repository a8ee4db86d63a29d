"""A storage root: the folder or URI under which a run keeps what must outlive any one node.

``Storage(location)`` opens ``location`` with ``pyarrow.fs``: a local path (the single-node case,
or a folder every node mounts, e.g. NFS) or a URI — ``s3://bucket/prefix``, ``gs://bucket/prefix``,
``abfs://container@account.dfs.core.windows.net/prefix``, ``hdfs://host:port/path`` — whichever of
them the installed pyarrow and the user's credentials support. Options may ride in the URI's query
(``s3://bucket/run?endpoint_override=host:9000&scheme=http``); otherwise S3 reads the AWS SDK's
environment: ``AWS_ENDPOINT_URL`` (an S3-compatible server), ``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ``AWS_DEFAULT_REGION``/``AWS_REGION``, and
``AWS_PROFILE`` with ``~/.aws``. Every process that opens the root (driver, learner, warm start) reads
its own environment, so those variables must be set on every node (or in ``ray.env_vars``).

Paths inside a root are ``PurePath`` values: a ``pathlib.Path`` for a local root (local code keeps
using pathlib on them) and a ``PurePosixPath`` of the filesystem's own path (``bucket/prefix/...``)
for a URI. ``uri(path)`` names one for messages and for actors, which open it again themselves.

Writes: a local file is written to a hidden temp file, fsync'd and renamed over its name, so it is
whole or absent. An object store shows an object only once its upload completes, so a remote write
serialises into memory first and then uploads: an exception never leaves half an object behind.
Object stores have no rename; ``move`` of a remote folder copies and deletes object by object.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path, PurePath, PurePosixPath
from urllib.parse import urlsplit

from sliderl.trainer.manifest import FileEntry, write_file

# URI schemes pyarrow.fs opens (s3, gs/gcs, abfs/abfss, hdfs/viewfs need their client libraries)
SCHEMES = ("s3", "gs", "gcs", "abfs", "abfss", "hdfs", "viewfs", "file")
_CHUNK = 1 << 20


def is_uri(location: str | os.PathLike) -> bool:
    """True for ``scheme://...``; False for a local path."""
    return "://" in str(location)


def check_location(location: str) -> str:
    """``location`` if it is a local path or a URI of a known scheme with a bucket (or host); else
    ValueError naming the value and what would be valid. Nothing is opened or contacted."""
    if not is_uri(location):
        return location
    parts = urlsplit(location)
    scheme = parts.scheme.lower()
    if scheme not in SCHEMES:
        raise ValueError(f"{location!r}: unknown storage scheme {parts.scheme!r}; use a local path or a URI "
                         f"of {', '.join(s + '://' for s in SCHEMES)} (e.g. s3://bucket/prefix)")
    if scheme != "file" and not parts.netloc:
        raise ValueError(f"{location!r} names no bucket or host; write {scheme}://BUCKET/prefix")
    return location


def check_writable_folder(folder: str | os.PathLike, key: str) -> Path:
    """``folder`` as a local path, once it (or, when missing, the nearest folder above it, where it would be
    created) is a folder a probe file can be written to and removed from; a ConfigError naming ``key`` otherwise
    (a file, a path under a file, a read-only or full disk). Creates nothing."""
    from sliderl.cluster.errors import ConfigError

    path = Path(folder).expanduser().absolute()
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        where = "is a file" if existing == path else f"lies under the file {existing}"
        raise ConfigError(f"{key}={str(folder)!r} {where}, not a folder; choose a folder (it is created when missing)")
    probe = existing / f".sliderl-write-check-{os.getpid()}"
    try:
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        raise ConfigError(f"{key}={str(folder)!r} cannot be written ({err.strerror or err} in {existing}); choose a "
                          "writable folder") from None
    return path


class Storage:
    """Files under one root, local or remote, through ``pyarrow.fs``."""

    def __init__(self, location: str | os.PathLike):
        from pyarrow import fs

        text = str(location)
        if text.startswith("file://"):
            text = urlsplit(text).path
        self.local = not is_uri(text)
        if self.local:
            self.fs = fs.LocalFileSystem()
            self.root: PurePath = Path(text).expanduser().resolve()
            self.location = str(self.root)
            self._query = ""
        else:
            check_location(text)
            self.fs, base = fs.FileSystem.from_uri(text)
            self.root = PurePosixPath(base.rstrip("/"))
            head, _, query = text.partition("?")
            self.location, self._query = head.rstrip("/"), f"?{query}" if query else ""

    # ---- naming ---------------------------------------------------------------------------------
    def path(self, *parts: str) -> PurePath:
        """The path of ``parts`` under the root."""
        return self.root.joinpath(*parts)

    def uri(self, path: PurePath) -> str:
        """What names ``path`` outside this process: the local path itself, or the root's URI extended."""
        if self.local:
            return str(path)
        rel = PurePosixPath(path).relative_to(self.root).as_posix()
        return (self.location if rel == "." else f"{self.location}/{rel}") + self._query

    # ---- reading --------------------------------------------------------------------------------
    def _info(self, path: PurePath):
        return self.fs.get_file_info(str(path))

    def is_file(self, path: PurePath) -> bool:
        from pyarrow.fs import FileType

        return self._info(path).type == FileType.File

    def is_dir(self, path: PurePath) -> bool:
        from pyarrow.fs import FileType

        return self._info(path).type == FileType.Directory

    def exists(self, path: PurePath) -> bool:
        from pyarrow.fs import FileType

        return self._info(path).type != FileType.NotFound

    def size(self, path: PurePath) -> int | None:
        """Bytes of the file ``path``; None when it is not a file."""
        from pyarrow.fs import FileType

        info = self._info(path)
        return info.size if info.type == FileType.File else None

    def children(self, path: PurePath) -> list[PurePath]:
        """The entries directly inside ``path`` (none when it does not exist)."""
        from pyarrow.fs import FileSelector

        found = self.fs.get_file_info(FileSelector(str(path), allow_not_found=True))
        return [path / PurePosixPath(info.path).name for info in found]

    def files(self, path: PurePath) -> list[str]:
        """Every file under the folder ``path``, as paths relative to it (posix), sorted."""
        from pyarrow.fs import FileSelector, FileType

        found = self.fs.get_file_info(FileSelector(str(path), recursive=True, allow_not_found=True))
        base = str(path).rstrip("/") + "/"
        return sorted(info.path[len(base):] for info in found if info.type == FileType.File)

    def read_bytes(self, path: PurePath) -> bytes:
        with self.fs.open_input_stream(str(path)) as stream:
            return stream.read()

    def sha256(self, path: PurePath) -> str:
        """Hex sha256 of the file's content, read once in chunks."""
        digest = hashlib.sha256()
        with self.fs.open_input_stream(str(path)) as stream:
            while chunk := stream.read(_CHUNK):
                digest.update(chunk)
        return digest.hexdigest()

    def open_input(self, path: PurePath):
        """A random-access file (what ``pyarrow.parquet`` reads)."""
        return self.fs.open_input_file(str(path))

    # ---- writing --------------------------------------------------------------------------------
    def make_dir(self, path: PurePath) -> None:
        """Create the folder ``path`` (a no-op where folders are only key prefixes)."""
        if self.local:
            Path(path).mkdir(parents=True, exist_ok=True)

    def write_bytes(self, path: PurePath, data: bytes) -> FileEntry:
        """Write ``data`` as the whole file ``path`` (whole or absent after a crash); its entry."""
        if self.local:
            temp = Path(path).with_name(f".{Path(path).name}.tmp-{os.getpid()}")
            try:
                entry = write_file(temp, data)
                os.replace(temp, path)
            finally:
                temp.unlink(missing_ok=True)
            return entry
        with self.fs.open_output_stream(str(path)) as out:
            out.write(data)
        return FileEntry(len(data), hashlib.sha256(data).hexdigest())

    def delete(self, path: PurePath) -> None:
        """Remove the file or folder ``path`` (nothing when it is not there)."""
        from pyarrow.fs import FileType

        kind = self._info(path).type
        if kind == FileType.Directory:
            self.fs.delete_dir(str(path))
        elif kind == FileType.File:
            self.fs.delete_file(str(path))

    def move(self, source: PurePath, dest: PurePath) -> None:
        """Rename the file or folder ``source`` to ``dest`` (remote folders: object by object)."""
        if self.local or self.is_file(source):
            self.fs.move(str(source), str(dest))
            return
        for rel in self.files(source):
            self.fs.move(str(source / rel), str(dest / rel))
        self.delete(source)

    # ---- to and from a local folder --------------------------------------------------------------
    def upload(self, local_dir: str | os.PathLike, dest: PurePath, last: str | None = None) -> None:
        """Copy every file under ``local_dir`` to the folder ``dest``; the file named ``last`` (a marker)
        goes after all the others."""
        from pyarrow import fs

        local = Path(local_dir)
        names = sorted(str(p.relative_to(local).as_posix()) for p in local.rglob("*") if p.is_file())
        names.sort(key=lambda name: name == last)
        self.make_dir(dest)
        for name in names:
            if self.local:
                Path(dest / name).parent.mkdir(parents=True, exist_ok=True)
            fs.copy_files(str(local / name), str(dest / name), source_filesystem=fs.LocalFileSystem(),
                          destination_filesystem=self.fs)

    def download(self, source: PurePath, local_dir: str | os.PathLike) -> list[str]:
        """Copy every file under the folder ``source`` into ``local_dir``; their relative paths."""
        from pyarrow import fs

        names = self.files(source)
        for name in names:
            target = Path(local_dir) / name
            target.parent.mkdir(parents=True, exist_ok=True)
            fs.copy_files(str(source / name), str(target), source_filesystem=self.fs,
                          destination_filesystem=fs.LocalFileSystem())
        return names
