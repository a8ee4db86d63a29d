"""Local data files checked before ``datasets`` reads them: a bad file is one line naming the file, the line
(or row) and what is wrong.

Read as they are, ``datasets`` turns an empty JSONL file into a bare ``StopIteration``, a UTF-16 file or one
with invalid UTF-8 into a traceback naming neither file nor row, a field that is text in one row and an
object in another into the text ``"{'a': 3}"``, a 0-row Parquet file into ``BatchSize must be greater than
0``, and a 50 MB line into ~20 GB of memory. ``check_data_files`` reads each file once, a line at a time and
never more than ``max_line_bytes`` + 1 bytes of a line, and raises ``ConfigError`` at the first problem:

- JSON Lines (``.jsonl``, and ``.json`` that is not one array): every non-blank line is UTF-8 (a UTF-8
  byte-order mark is fine, UTF-16 is not) and one JSON object; a field holds one kind of value in every
  row (text, number, true/false, list or object; null goes with any); at least one row;
- a ``.json`` array: its elements are those rows (its lines bounded the same way);
- Parquet: the footer reads and the file has rows; the files of a folder have one schema.
"""

from __future__ import annotations

import json
from pathlib import Path

from sliderl.cluster.errors import ConfigError

DEFAULT_MAX_LINE_BYTES = 4 * 2**20  # 4 MiB: about a million tokens of text in one row
JSON_SUFFIXES = (".jsonl", ".json")
PARQUET_SUFFIXES = (".parquet",)
_UTF16_BOMS = (b"\xff\xfe", b"\xfe\xff")
_UTF8_BOM = b"\xef\xbb\xbf"


def check_data_files(source: str, max_line_bytes: int = DEFAULT_MAX_LINE_BYTES) -> None:
    """Check the local data file or folder ``source`` (module docstring); ConfigError at the first problem."""
    path = Path(source).expanduser()
    files = [path] if path.is_file() else data_files(path)
    if not files:
        raise ConfigError(f"dataset folder {source!r} holds no .jsonl, .json or .parquet file")
    kinds: dict[str, tuple[str, str]] = {}  # field -> (kind of value, where it was first seen)
    schema: tuple[Path, object] | None = None
    for file in files:
        if file.suffix in PARQUET_SUFFIXES:
            schema = _check_parquet(file, schema)
        elif file.suffix in JSON_SUFFIXES:
            _check_json(file, max_line_bytes, kinds)


def data_files(folder: Path) -> list[Path]:
    """The data files under ``folder`` (any depth), hidden ones left out, in name order."""
    suffixes = JSON_SUFFIXES + PARQUET_SUFFIXES
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix in suffixes
                  and not any(part.startswith(".") for part in p.relative_to(folder).parts))


# ---- JSON ------------------------------------------------------------------------------------------------------


def _check_json(file: Path, max_line_bytes: int, kinds: dict[str, tuple[str, str]]) -> None:
    rows = 0
    with open(file, "rb") as stream:
        head = stream.read(4)
        if head.startswith(_UTF16_BOMS) or (len(head) >= 2 and 0 in head[:2]):
            raise ConfigError(f"data file {file} is UTF-16 (or another encoding with NUL bytes), not UTF-8; save it "
                              "as UTF-8 (e.g. iconv -f UTF-16 -t UTF-8)")
        stream.seek(len(_UTF8_BOM) if head.startswith(_UTF8_BOM) else 0)
        first = head.lstrip(_UTF8_BOM).lstrip()[:1]
        lines = _lines(file, stream, max_line_bytes)
        if file.suffix == ".json" and first == b"[":
            text = "".join(lines)  # every line bounded; the array is one document
            try:
                records = json.loads(text)
            except json.JSONDecodeError as err:
                raise ConfigError(f"data file {file} is not valid JSON: {err}") from None
            for row, record in enumerate(records):
                _check_row(record, f"row {row}", file, kinds)
            rows = len(records)
        else:
            for number, line in enumerate(lines, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as err:
                    raise ConfigError(f"data file {file} line {number} is not valid JSON ({err.msg} at column "
                                      f"{err.colno}): {line.strip()[:80]!r}") from None
                _check_row(record, f"line {number}", file, kinds)
                rows += 1
    if rows == 0:
        raise ConfigError(f"data file {file} has no rows (it is empty); give it one JSON object per line")


def _lines(file: Path, stream, max_line_bytes: int):
    """The file's lines as text, each read with at most ``max_line_bytes`` + 1 bytes in memory."""
    for number, raw in enumerate(iter(lambda: stream.readline(max_line_bytes + 1), b""), 1):
        if len(raw) - raw.endswith(b"\n") - raw.endswith(b"\r\n") > max_line_bytes:  # (no copy of the line)
            raise ConfigError(f"data file {file} line {number} is longer than data.max_line_bytes={max_line_bytes} "
                              "bytes, so it was not loaded (a row takes hundreds of times its size in memory to "
                              "load); split the row, or raise data.max_line_bytes")
        try:
            yield raw.decode("utf-8")
        except UnicodeDecodeError as err:
            raise ConfigError(f"data file {file} line {number} is not valid UTF-8 (byte 0x{raw[err.start]:02x} at "
                              f"byte {err.start + 1} of the line); save the file as UTF-8") from None


def _check_row(record, where: str, file: Path, kinds: dict[str, tuple[str, str]]) -> None:
    """``record`` is an object whose fields hold the kinds earlier rows gave them."""
    if not isinstance(record, dict):
        raise ConfigError(f"data file {file} {where} is a JSON {_kind(record)}, not an object with named fields "
                          f"({json.dumps(record)[:80]})")
    for key, value in record.items():
        kind = _kind(value)
        if kind == "null":
            continue
        seen = kinds.setdefault(key, (kind, f"{file.name} {where}"))
        if seen[0] != kind:
            raise ConfigError(f"data file {file} {where}: field {key!r} is {_a(kind)} ({json.dumps(value)[:60]}) where "
                              f"{seen[1]} has {_a(seen[0])}; rows must share one schema (write every {key!r} as "
                              f"{_a(seen[0])})")


def _kind(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true/false value"
    if isinstance(value, (int, float)):
        return "number"
    return {str: "text", list: "list", dict: "object"}[type(value)]


def _a(kind: str) -> str:
    return f"an {kind}" if kind[0] in "aeiou" else f"a {kind}"


# ---- Parquet ---------------------------------------------------------------------------------------------------


def _check_parquet(file: Path, schema: tuple[Path, object] | None) -> tuple[Path, object]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        meta = pq.ParquetFile(file).metadata
    except (pa.ArrowException, OSError) as err:
        raise ConfigError(f"data file {file} is not a readable Parquet file: {' '.join(str(err).split())}") from None
    if meta.num_rows == 0:
        raise ConfigError(f"data file {file} has no rows (a Parquet file of 0 rows)")
    own = meta.schema.to_arrow_schema()
    if schema is not None and not own.equals(schema[1]):
        raise ConfigError(f"data file {file} has other columns than {schema[0]} ({', '.join(own.names)} vs "
                          f"{', '.join(schema[1].names)}, or other types); the files of a dataset share one schema")
    return schema or (file, own)
