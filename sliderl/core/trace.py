"""The Trace record: one sampled completion, everything the learner needs to rebuild its context.

A trace crosses process boundaries (rollout worker -> queue -> learner) and is one row of the
Parquet trace log. Visibility is a function of (kv_policy, prompt length, token ids) — plus, for a
score-based policy (h2o), the death positions the engine recorded (``kv_deaths``), and for a restart policy
(last_k, summary) the contexts it restarted from (``restarts``, ``core.restart``) — so the record carries the
policy spec string, those deaths and those contexts rather than any mask.

``TRACE_SCHEMA_VERSION`` numbers the Parquet schema; each row stores the version it was written with
(``schema_version``). Version 1 (no such column) is every log written before restarts: its rows read with the
columns added since at their defaults.
"""

from __future__ import annotations

import typing
from dataclasses import asdict, dataclass, field, fields
from typing import Annotated

import pyarrow as pa

from sliderl.core.restart import Restart

# Python type + the Arrow type of its Parquet column; every Trace field is declared with one of these
String = Annotated[str, pa.string()]
Int32 = Annotated[int, pa.int32()]
Int64 = Annotated[int, pa.int64()]
Float32 = Annotated[float, pa.float32()]
Float64 = Annotated[float, pa.float64()]
Int32List = Annotated[list[int], pa.list_(pa.int32())]
Float32List = Annotated[list[float], pa.list_(pa.float32())]
BoolList = Annotated[list[bool], pa.list_(pa.bool_())]
Float64Map = Annotated[dict[str, float], pa.map_(pa.string(), pa.float64())]  # stored as (key, value) pairs
RestartList = Annotated[list[Restart], pa.list_(pa.struct([
    ("at", pa.int32()), ("kept_prompt", pa.int32()), ("context_tail", pa.list_(pa.int32())),
    ("carry_start", pa.int32()), ("carry_end", pa.int32()), ("forced", pa.bool_())]))]

TRACE_SCHEMA_VERSION = 2  # 2: restarts and the cost columns; 1: logs written before them (no schema_version)


@dataclass
class Trace:
    trace_id: String
    group_id: String  # the n samples of one prompt share it; groups are atomic for the learner
    prompt_id: String
    worker_id: Int32
    policy_version: Int64  # weights version when sampling started
    kv_policy: String  # spec string, e.g. "prefix_sliding:4096"
    prompt_token_ids: Int32List
    completion_token_ids: Int32List
    logprobs: Float32List  # the sampler's, per completion token
    finish_reason: String
    temperature: Float32 = 1.0
    weight_update_token_index: Int32 = -1  # completion index where newer weights took over, -1 if none
    forced: BoolList = field(default_factory=list)  # budget-forced tokens (excluded from the loss)
    reward: Float64 = 0.0
    reward_components: Float64Map = field(default_factory=dict)
    answer: String = ""
    completion_text: String = ""
    num_tokens: Int32 = 0
    peak_visible_kv: Int32 = 0
    mean_visible_kv: Float64 = 0.0
    decode_seconds: Float64 = 0.0
    kv_deaths: Int32List = field(default_factory=list)  # h2o: evicted ranges, flat (start, end, death) triples
    num_preemptions: Int32 = 0  # times the engine took this request's blocks back and recomputed it (pool too small)
    restarts: RestartList = field(default_factory=list)  # last_k / summary: each restart and its new context
    reencoded_tokens: Int32 = 0  # tokens encoded again at restarts (sum of the restarts' context tails)
    kv_token_steps: Int64 = 0  # sum over generated tokens of the KV tokens the query that chose it saw
    max_token_seconds: Float64 = 0.0  # longest wait for one token after the first (a restart's re-prefill spike)
    schema_version: Int32 = TRACE_SCHEMA_VERSION  # the Parquet schema this row was written with; old logs: 1

    @property
    def death_ranges(self) -> list[tuple[int, int, int]]:
        """``kv_deaths`` as ``(start, end, death)`` ranges: positions start .. end - 1 die at death."""
        if len(self.kv_deaths) % 3:
            raise ValueError(f"trace {self.trace_id!r} has {len(self.kv_deaths)} kv_deaths entries; "
                             "they must be (start, end, death) triples")
        d = self.kv_deaths
        return [(d[i], d[i + 1], d[i + 2]) for i in range(0, len(d), 3)]

    @staticmethod
    def flat_deaths(ranges: list[tuple[int, int, int]]) -> list[int]:
        """``RequestOutput.kv_deaths`` ranges as the flat list ``kv_deaths`` stores."""
        return [x for r in ranges for x in r]

    def to_row(self) -> dict:
        row = asdict(self)
        row["reward_components"] = list(self.reward_components.items())
        return row

    @classmethod
    def from_row(cls, row: dict) -> Trace:
        row = dict(row)
        row["reward_components"] = dict(row.get("reward_components") or [])
        row["kv_deaths"] = list(row.get("kv_deaths") or [])  # absent from logs written before h2o
        row["num_preemptions"] = int(row.get("num_preemptions") or 0)  # logs older than this column lack it: read as 0
        row["restarts"] = [r if isinstance(r, Restart) else Restart(**r) for r in row.get("restarts") or []]
        for name, zero in (("reencoded_tokens", 0), ("kv_token_steps", 0), ("max_token_seconds", 0.0)):
            row[name] = row.get(name) or zero  # version 1 logs lack these columns
        row["schema_version"] = row.get("schema_version") or 1
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in row.items() if k in names})


def arrow_schema(record: type) -> pa.Schema:
    """The Arrow schema of a dataclass whose fields are all annotated ``Annotated[T, <pa.DataType>]``,
    one column per field in declaration order; TypeError naming a field without an Arrow type."""
    hints = typing.get_type_hints(record, include_extras=True)
    columns = []
    for f in fields(record):
        arrow = [m for m in getattr(hints[f.name], "__metadata__", ()) if isinstance(m, pa.DataType)]
        if len(arrow) != 1:
            raise TypeError(f"{record.__name__}.{f.name} needs exactly one Arrow type (e.g. Int32), "
                            f"got {hints[f.name]!r}")
        columns.append((f.name, arrow[0]))
    return pa.schema(columns)


TRACE_SCHEMA = arrow_schema(Trace)


def traces_to_table(traces: list[Trace]) -> pa.Table:
    return pa.Table.from_pylist([t.to_row() for t in traces], schema=TRACE_SCHEMA)


def traces_from_table(table: pa.Table) -> list[Trace]:
    return [Trace.from_row(r) for r in table.to_pylist()]
