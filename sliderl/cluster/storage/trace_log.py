"""The trace log: every sampled trace, appended to Parquet part files in ``run_dir/traces/``.

The log is the durable record of what was sampled. ``run_dir`` is a storage root
(``cluster.storage.root``): a local folder or a URI such as ``s3://bucket/run``. Each ``append`` writes one
new, complete part file ``part-NNNNNN.parquet`` (one row per trace, ``core.trace.TRACE_SCHEMA``).
``add`` gathers traces in memory instead and ``flush`` writes them as one part (``add`` flushes by itself
once ``part_rows`` traces wait), so a run writes a few large parts rather than one small part per group;
the driver flushes before every checkpoint and when a session ends, so the log holds every group a
checkpoint resolved. In a local folder:

    convert -> write ``.part-NNNNNN.parquet.tmp-PID`` -> fsync -> link to its final name -> fsync dir

so a crash at any point leaves either the whole part or no part; parts already written are never
touched again. Names starting with ``.`` are invisible to readers (``pyarrow.dataset`` skips them
by default), so a temp file left by a killed process is ignored. Numbering continues after the
highest existing part, so a resumed run keeps appending to the same folder; linking (not renaming)
refuses to overwrite, so two writers on one folder never clobber each other's parts.

In an object store the part is serialised in memory and uploaded as one object, which appears whole
or not at all; there is no link, so a remote log has one writer (the driver).
"""

from __future__ import annotations

import os
import re
from pathlib import Path, PurePath

import pyarrow as pa
import pyarrow.parquet as pq

from sliderl.cluster.storage.root import Storage
from sliderl.core.trace import TRACE_SCHEMA, Trace, traces_to_table

PART_NAME = "part-{:06d}.parquet"
PART_ROWS = 2048  # traces ``add`` gathers before it writes a part by itself
_PART_RE = re.compile(r"part-(\d+)\.parquet")


class TraceLog:
    """Append-only Parquet log of ``Trace`` records under ``run_dir/traces/``."""

    def __init__(self, run_dir: str | os.PathLike | Storage, part_rows: int = PART_ROWS):
        self.storage = run_dir if isinstance(run_dir, Storage) else Storage(run_dir)
        self.dir = self.storage.path("traces")
        self.storage.make_dir(self.dir)
        self._rows: dict[str, int] = {}  # part name -> rows; parts are immutable once named
        parts = self.parts()
        self._next = _part_number(parts[-1]) + 1 if parts else 0
        self.part_rows = part_rows
        self._pending: list[Trace] = []  # added, not yet written

    def add(self, traces: list[Trace]) -> PurePath | None:
        """Gather ``traces`` for the next part; once ``part_rows`` wait, write them (the part's path, else None)."""
        self._pending.extend(traces)
        return self.flush() if len(self._pending) >= self.part_rows else None

    def flush(self) -> PurePath | None:
        """Write every gathered trace as one part (``append``); its path, or None when none waited. A failed
        write keeps them gathered."""
        path = self.append(self._pending)
        self._pending = []
        return path

    @property
    def pending(self) -> int:
        """Traces gathered and not yet written."""
        return len(self._pending)

    def append(self, traces: list[Trace]) -> PurePath | None:
        """Write ``traces`` as one new part file; returns its path (None for an empty list).

        A trace that does not fit the schema raises before anything reaches the disk; an error
        while writing removes the temp file and re-raises. Either way no part is added.
        """
        if not traces:
            return None
        table = traces_to_table(traces)  # raises (ArrowInvalid/ArrowTypeError/...) on a bad row
        if not self.storage.local:
            path = self.dir / PART_NAME.format(self._next)
            self.storage.write_bytes(path, _parquet_bytes(table))
            self._next += 1
            self._rows[path.name] = table.num_rows
            return path
        temp = self.dir / f".{PART_NAME.format(self._next)}.tmp-{os.getpid()}"
        try:
            _write_synced(table, temp)
            path = self._move_into_place(temp)
        finally:
            temp.unlink(missing_ok=True)
        self._rows[path.name] = table.num_rows
        return path

    def parts(self) -> list[PurePath]:
        """The complete part files, in append order."""
        found = [p for p in self.storage.children(self.dir) if _PART_RE.fullmatch(p.name)]
        return sorted(found, key=_part_number)

    def read(self, columns: list[str] | None = None) -> pa.Table:
        """Every trace written so far (all parts, in append order) as one table of ``TRACE_SCHEMA``."""
        parts = self.parts()
        if not parts:
            empty = TRACE_SCHEMA.empty_table()
            return empty.select(columns) if columns is not None else empty
        return pa.concat_tables([self._read_part(p, columns) for p in parts])

    def count(self) -> int:
        """Number of traces in the log (row counts from each part's footer, cached)."""
        total = 0
        for part in self.parts():
            if part.name not in self._rows:
                with self.storage.open_input(part) as file:
                    self._rows[part.name] = pq.ParquetFile(file).metadata.num_rows
            total += self._rows[part.name]
        return total

    def keep_groups(self, group_ids: set[str]) -> int:
        """Drop every logged trace whose group is not in ``group_ids``; returns how many were dropped.

        A resume rolls the log back to its checkpoint this way: groups logged after it (or logged but
        not resolved by it) are generated and logged again, so each group stays in the log once. A part
        that loses rows is rewritten to a temp file and replaces the old one atomically (one dropped
        entirely is deleted); parts that keep every row are not touched.
        """
        dropped = 0
        for part in self.parts():
            table = self._read_part(part)
            keep = pa.array([g in group_ids for g in table.column("group_id").to_pylist()], type=pa.bool_())
            kept = table.filter(keep)
            if kept.num_rows == table.num_rows:
                continue
            dropped += table.num_rows - kept.num_rows
            self._rows.pop(part.name, None)
            if kept.num_rows == 0:
                self.storage.delete(part)
            elif self.storage.local:
                temp = self.dir / f".{part.name}.rollback-{os.getpid()}"
                _write_synced(kept, temp)
                os.replace(temp, part)
            else:
                self.storage.write_bytes(part, _parquet_bytes(kept))  # replaces the object whole
        if self.storage.local:
            _fsync_dir(self.dir)
        return dropped

    def _read_part(self, part: PurePath, columns: list[str] | None = None) -> pa.Table:
        return pq.read_table(str(part), columns=columns, schema=TRACE_SCHEMA, filesystem=self.storage.fs)

    def _move_into_place(self, temp: Path) -> Path:
        """Give ``temp`` the next free part name without ever replacing an existing part."""
        while True:
            path = self.dir / PART_NAME.format(self._next)
            self._next += 1
            try:
                os.link(temp, path)
            except FileExistsError:  # another writer took this number
                continue
            except OSError:  # no hard links on this filesystem: rename (one writer per folder)
                if path.exists():
                    continue
                os.replace(temp, path)
            _fsync_dir(self.dir)
            return path


def _part_number(path: Path) -> int:
    return int(_PART_RE.fullmatch(path.name).group(1))


def _parquet_bytes(table: pa.Table) -> bytes:
    """``table`` as the bytes of one Parquet file."""
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    return sink.getvalue().to_pybytes()


def _write_synced(table: pa.Table, path: Path) -> None:
    """Write ``table`` as Parquet to ``path`` and force it to stable storage."""
    with open(path, "wb") as file:
        pq.write_table(table, file)
        file.flush()
        os.fsync(file.fileno())


def _fsync_dir(path: Path) -> None:
    """Make a new directory entry durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
