"""TraceLog: traces appended as Parquet parts, read back field by field, durable across restarts
and failures, readable by pyarrow.dataset. Expected rows are the Trace objects written, compared
through pyarrow's own reading of the files (float32 columns with float32 tolerance)."""

import os
import subprocess
import sys
import textwrap
from dataclasses import asdict, field, make_dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from sliderl.cluster.storage.trace_log import TraceLog
from sliderl.core.restart import Restart
from sliderl.core.trace import TRACE_SCHEMA, TRACE_SCHEMA_VERSION, Int32, Trace, arrow_schema, traces_from_table

ROOT = Path(__file__).resolve().parents[1]
FLOAT32_FIELDS = {"logprobs", "temperature"}  # float32 in TRACE_SCHEMA


def make_trace(i: int, **overrides) -> Trace:
    fields = dict(
        trace_id=f"t{i}", group_id=f"g{i // 2}", prompt_id=f"p{i // 2}", worker_id=i % 3,
        policy_version=10 + i, kv_policy="prefix_sliding:64",
        prompt_token_ids=[1, 2, 3 + i], completion_token_ids=list(range(100, 100 + i + 1)),
        logprobs=[-0.1 * (k + 1) for k in range(i + 1)], finish_reason="stop" if i % 2 else "length",
        temperature=0.7, weight_update_token_index=i - 1, forced=[k == i for k in range(i + 1)],
        reward=0.25 * i, reward_components={"correct": float(i % 2), "kv_penalty": -0.01 * i},
        answer=str(i), completion_text=f"ans {i} é", num_tokens=i + 1, peak_visible_kv=40 + i,
        mean_visible_kv=30.5 + i, decode_seconds=0.125 * i,
    )
    fields.update(overrides)
    return Trace(**fields)


def assert_rows_equal(rows: list[dict], traces: list[Trace]) -> None:
    assert len(rows) == len(traces)
    for row, trace in zip(rows, traces):
        expected = asdict(trace)
        expected["reward_components"] = list(trace.reward_components.items())  # Arrow map -> pairs
        assert set(row) == set(expected)
        for name, value in expected.items():
            if name in FLOAT32_FIELDS:
                assert row[name] == pytest.approx(value, rel=1e-6), name
            else:
                assert row[name] == value, name


def visible_files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_append_reads_back_every_field_in_order(tmp_path):
    log = TraceLog(tmp_path)
    batches = [[make_trace(0), make_trace(1)], [make_trace(2)], [make_trace(3), make_trace(4), make_trace(5)]]
    paths = [log.append(batch) for batch in batches]

    assert [p.name for p in paths] == ["part-000000.parquet", "part-000001.parquet", "part-000002.parquet"]
    assert visible_files(tmp_path / "traces") == [p.name for p in paths]  # no temp files left
    assert [pq.ParquetFile(p).metadata.num_rows for p in paths] == [2, 1, 3]
    all_traces = [t for batch in batches for t in batch]
    assert_rows_equal(log.read().to_pylist(), all_traces)
    assert log.count() == 6
    assert log.read(columns=["trace_id"]).column("trace_id").to_pylist() == [f"t{i}" for i in range(6)]


def test_empty_log_and_empty_append(tmp_path):
    log = TraceLog(tmp_path)
    assert log.append([]) is None
    assert visible_files(tmp_path / "traces") == []
    assert log.count() == 0
    table = log.read()
    assert table.num_rows == 0 and "trace_id" in table.column_names


def test_new_log_on_same_dir_continues_numbering_and_keeps_parts(tmp_path):
    first = TraceLog(tmp_path)
    first.append([make_trace(0)])
    first.append([make_trace(1), make_trace(2)])
    before = {p.name: p.read_bytes() for p in first.parts()}

    resumed = TraceLog(tmp_path)  # a restarted run
    assert resumed.count() == 3
    path = resumed.append([make_trace(3)])

    assert path.name == "part-000002.parquet"
    assert {p.name: p.read_bytes() for p in resumed.parts() if p.name in before} == before
    assert_rows_equal(resumed.read().to_pylist(), [make_trace(i) for i in range(4)])
    assert first.count() == 4  # the first handle sees the new part too


def test_bad_row_adds_no_part_and_keeps_earlier_ones(tmp_path):
    log = TraceLog(tmp_path)
    log.append([make_trace(0)])
    bad = make_trace(1, logprobs=["not a number"])

    with pytest.raises((pa.ArrowException, TypeError, ValueError)):
        log.append([make_trace(2), bad])

    assert visible_files(tmp_path / "traces") == ["part-000000.parquet"]
    assert_rows_equal(log.read().to_pylist(), [make_trace(0)])
    assert log.append([make_trace(3)]).name == "part-000001.parquet"


def test_failure_while_writing_removes_the_temp_file(tmp_path, monkeypatch):
    log = TraceLog(tmp_path)
    log.append([make_trace(0)])

    def disk_full(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", disk_full)  # the temp file exists, fully written, when this fires
    with pytest.raises(OSError, match="No space"):
        log.append([make_trace(1)])
    monkeypatch.undo()

    assert visible_files(tmp_path / "traces") == ["part-000000.parquet"]
    assert log.append([make_trace(2)]).name == "part-000001.parquet"
    assert_rows_equal(log.read().to_pylist(), [make_trace(0), make_trace(2)])


def test_killed_writer_leaves_only_complete_parts(tmp_path):
    # a child process appends 2-trace batches as fast as it can and is SIGKILLed after its third
    # part: wherever the kill lands, every named part is complete and temp files stay invisible
    child = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(ROOT)!r})
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from sliderl.cluster.storage.trace_log import TraceLog
        from test_trace_log import make_trace
        log = TraceLog({str(tmp_path)!r})
        i = 0
        while True:
            log.append([make_trace(i), make_trace(i + 1)])
            i += 2
            print(i, flush=True)
    """)
    proc = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, text=True)
    try:
        for _ in range(3):
            assert proc.stdout.readline(), "writer exited early"
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()

    log = TraceLog(tmp_path)
    parts = log.parts()
    assert len(parts) >= 3
    assert [p.name for p in parts] == [f"part-{n:06d}.parquet" for n in range(len(parts))]
    n = 2 * len(parts)
    assert log.count() == n
    assert_rows_equal(log.read().to_pylist(), [make_trace(i) for i in range(n)])
    assert ds.dataset(tmp_path / "traces", format="parquet").count_rows() == n


def test_pyarrow_dataset_reads_the_folder_and_ignores_temp_files(tmp_path):
    log = TraceLog(tmp_path)
    log.append([make_trace(0), make_trace(1)])
    log.append([make_trace(2)])
    (tmp_path / "traces" / ".part-000002.parquet.tmp-999").write_bytes(b"PAR1 cut short")

    table = ds.dataset(tmp_path / "traces", format="parquet").to_table()

    assert sorted(table.column("trace_id").to_pylist()) == ["t0", "t1", "t2"]
    assert table.schema.field("logprobs").type == pa.list_(pa.float32())
    assert TraceLog(tmp_path).append([make_trace(3)]).name == "part-000002.parquet"


# The column types of every Parquet part written so far: a trace log must stay readable.
PARQUET_COLUMNS = [
    ("trace_id", pa.string()), ("group_id", pa.string()), ("prompt_id", pa.string()),
    ("worker_id", pa.int32()), ("policy_version", pa.int64()), ("kv_policy", pa.string()),
    ("prompt_token_ids", pa.list_(pa.int32())), ("completion_token_ids", pa.list_(pa.int32())),
    ("logprobs", pa.list_(pa.float32())), ("finish_reason", pa.string()), ("temperature", pa.float32()),
    ("weight_update_token_index", pa.int32()), ("forced", pa.list_(pa.bool_())), ("reward", pa.float64()),
    ("reward_components", pa.map_(pa.string(), pa.float64())), ("answer", pa.string()),
    ("completion_text", pa.string()), ("num_tokens", pa.int32()), ("peak_visible_kv", pa.int32()),
    ("mean_visible_kv", pa.float64()), ("decode_seconds", pa.float64()),
    ("kv_deaths", pa.list_(pa.int32())),  # added for h2o; parts written before it lack it
    ("num_preemptions", pa.int32()),  # added 2026-12-03; parts written before it lack it
    # schema version 2 (restarts): parts written before lack these five
    ("restarts", pa.list_(pa.struct([("at", pa.int32()), ("kept_prompt", pa.int32()),
                                     ("context_tail", pa.list_(pa.int32())), ("carry_start", pa.int32()),
                                     ("carry_end", pa.int32()), ("forced", pa.bool_())]))),
    ("reencoded_tokens", pa.int32()), ("kv_token_steps", pa.int64()), ("max_token_seconds", pa.float64()),
    ("schema_version", pa.int32()),
]


def test_trace_schema_is_the_parquet_columns_in_field_order():
    # catches: a Trace field whose Arrow type changed (int32 -> int64, float32 -> float64, ...) or a
    # field added, removed or moved, so the trace log would no longer read the parts already written
    assert TRACE_SCHEMA.equals(pa.schema(PARQUET_COLUMNS))
    assert TRACE_SCHEMA.names == [f.name for f in Trace.__dataclass_fields__.values()]


def test_a_trace_field_without_an_arrow_type_is_refused():
    # catches: a field added to Trace as a plain ``int`` that the derivation would skip or guess,
    # leaving the dataclass and the Parquet schema out of step
    extended = make_dataclass("Extended", [("extra", int, field(default=0))], bases=(Trace,))
    with pytest.raises(TypeError, match=r"Extended\.extra needs exactly one Arrow type"):
        arrow_schema(extended)
    typed = make_dataclass("Typed", [("extra", Int32, field(default=0))], bases=(Trace,))
    assert arrow_schema(typed).field("extra").type == pa.int32()


def test_keep_groups_rolls_the_log_back_part_by_part(tmp_path):
    # Catches: a rollback that drops the wrong rows, leaves a part it emptied, rewrites parts it
    # need not touch, or leaves a temp file behind (issue 11, bug 6: each group logged once).
    log = TraceLog(tmp_path)
    mixed = log.append([make_trace(0, group_id="g1"), make_trace(1, group_id="g2"), make_trace(2, group_id="g1")])
    only_g3 = log.append([make_trace(3, group_id="g3")])
    only_g2 = log.append([make_trace(4, group_id="g2")])
    untouched = only_g3.stat().st_mtime_ns
    assert log.keep_groups({"g1", "g3"}) == 2
    assert [p.name for p in log.parts()] == [mixed.name, only_g3.name] and not only_g2.exists()
    assert only_g3.stat().st_mtime_ns == untouched
    assert [(r["trace_id"], r["group_id"]) for r in log.read(["trace_id", "group_id"]).to_pylist()] == \
        [("t0", "g1"), ("t2", "g1"), ("t3", "g3")]
    assert log.count() == 3 and visible_files(tmp_path / "traces") == [mixed.name, only_g3.name]


def test_a_part_written_before_kv_deaths_still_reads(tmp_path):
    # catches: the h2o column (or the preemption count, or schema version 2's restart columns, added later) made
    # mandatory, so a log written before it fails to read or gives None where the learner expects a list or a number
    added = ("kv_deaths", "num_preemptions", "restarts", "reencoded_tokens", "kv_token_steps", "max_token_seconds",
             "schema_version")
    old = pa.schema([f for f in TRACE_SCHEMA if f.name not in added])
    rows = [{k: v for k, v in make_trace(0).to_row().items() if k not in added}]
    log = TraceLog(tmp_path)
    pq.write_table(pa.Table.from_pylist(rows, schema=old), log.dir / "part-000000.parquet")
    (trace,) = traces_from_table(log.read())
    assert trace.kv_deaths == [] and trace.num_preemptions == 0 and trace.trace_id == make_trace(0).trace_id
    assert trace.restarts == [] and trace.reencoded_tokens == 0 and trace.kv_token_steps == 0
    assert trace.max_token_seconds == 0.0 and trace.schema_version == 1


def test_added_traces_are_written_as_one_part_when_flushed_or_when_enough_wait(tmp_path):
    # Catches (issue 37): a run writing one small part per group (975 files for the default job). Added traces
    # reach the disk as one part at a flush (the driver's checkpoints and session ends) or once part_rows wait,
    # and readers see exactly the traces added, in order. Planted with add() writing at once (append), three
    # parts appear where this expects one.
    log = TraceLog(tmp_path, part_rows=5)
    assert log.add([make_trace(0), make_trace(1)]) is None and log.add([make_trace(2)]) is None
    assert visible_files(tmp_path / "traces") == [] and log.pending == 3
    first = log.flush()
    assert visible_files(tmp_path / "traces") == [first.name] and log.pending == 0 and log.flush() is None
    second = log.add([make_trace(i) for i in range(3, 9)])  # 6 >= part_rows: written at once
    assert second is not None and log.pending == 0
    assert [pq.ParquetFile(p).metadata.num_rows for p in log.parts()] == [3, 6]
    assert_rows_equal(ds.dataset(tmp_path / "traces", format="parquet").to_table().to_pylist(),
                      [make_trace(i) for i in range(9)])


def test_a_rollback_keeps_every_trace_of_the_groups_a_checkpoint_resolved(tmp_path):
    # Catches (issue 37): a resume's rollback deleting traces of groups that were already trained. With parts of
    # many groups (a part per checkpoint), one part holds groups trained before the checkpoint and groups that
    # arrived after it: the rollback keeps every trace of the former, byte for byte in its rows, and only the
    # latter go. Planted with keep_groups deleting any part that loses a row, g1 and g2 lose their traces.
    from sliderl.cluster.run.checkpoints import DriverState
    from sliderl.cluster.run.ledger import LedgerState
    from sliderl.cluster.run.resume import roll_back

    log = TraceLog(tmp_path)
    log.add([make_trace(i, group_id=f"g{i // 2}") for i in range(4)])  # g0, g1: trained by step 1
    log.flush()
    log.add([make_trace(i, group_id=f"g{i // 2}") for i in range(4, 10)])  # g2 stale at step 2; g3, g4 after it
    log.flush()
    state = DriverState(step=2, ledger=LedgerState(trained=["g0", "g1"], stale=["g2"]))
    roll_back((tmp_path / "checkpoints" / "step_000002", state), log, tmp_path / "metrics.jsonl")
    kept = TraceLog(tmp_path).read().to_pylist()
    assert_rows_equal(kept, [make_trace(i, group_id=f"g{i // 2}") for i in range(6)])


def test_restarts_round_trip_through_the_log_with_the_schema_version(tmp_path):
    # catches: a restart record that loses a field (or comes back as a dict) on its way through Parquet
    restart = Restart(at=12, kept_prompt=3, context_tail=[7, 8, 9], carry_start=5, carry_end=8, forced=False)
    trace = make_trace(0)
    trace.restarts, trace.reencoded_tokens = [restart], 3
    log = TraceLog(tmp_path)
    log.append([trace])
    (back,) = traces_from_table(log.read())
    assert back.restarts == [restart] and back.reencoded_tokens == 3 and back.schema_version == TRACE_SCHEMA_VERSION
