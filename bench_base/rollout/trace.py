"""The Trace record: one sampled completion, everything the learner needs to rebuild its context.

A trace crosses process boundaries (rollout worker -> queue -> learner) and is one row of the
Parquet trace log. Visibility is a pure function of (kv_policy, prompt length, token ids), so the
record carries the policy spec string rather than any mask.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

import pyarrow as pa


@dataclass
class Trace:
    trace_id: str
    group_id: str  # the n samples of one prompt share it; groups are atomic for the learner
    prompt_id: str
    worker_id: int
    policy_version: int  # weights version when sampling started
    kv_policy: str  # spec string, e.g. "prefix_sliding:4096"
    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    logprobs: list[float]  # the sampler's, per completion token
    finish_reason: str
    temperature: float = 1.0
    weight_update_token_index: int = -1  # completion index where newer weights took over, -1 if none
    forced: list[bool] = field(default_factory=list)  # budget-forced tokens (excluded from the loss)
    reward: float = 0.0
    reward_components: dict[str, float] = field(default_factory=dict)
    answer: str = ""
    completion_text: str = ""
    num_tokens: int = 0
    peak_visible_kv: int = 0
    mean_visible_kv: float = 0.0
    decode_seconds: float = 0.0

    def to_row(self) -> dict:
        row = asdict(self)
        row["reward_components"] = list(self.reward_components.items())
        return row

    @classmethod
    def from_row(cls, row: dict) -> Trace:
        row = dict(row)
        row["reward_components"] = dict(row.get("reward_components") or [])
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in row.items() if k in names})


TRACE_SCHEMA = pa.schema([
    ("trace_id", pa.string()),
    ("group_id", pa.string()),
    ("prompt_id", pa.string()),
    ("worker_id", pa.int32()),
    ("policy_version", pa.int64()),
    ("kv_policy", pa.string()),
    ("prompt_token_ids", pa.list_(pa.int32())),
    ("completion_token_ids", pa.list_(pa.int32())),
    ("logprobs", pa.list_(pa.float32())),
    ("finish_reason", pa.string()),
    ("temperature", pa.float32()),
    ("weight_update_token_index", pa.int32()),
    ("forced", pa.list_(pa.bool_())),
    ("reward", pa.float64()),
    ("reward_components", pa.map_(pa.string(), pa.float64())),
    ("answer", pa.string()),
    ("completion_text", pa.string()),
    ("num_tokens", pa.int32()),
    ("peak_visible_kv", pa.int32()),
    ("mean_visible_kv", pa.float64()),
    ("decode_seconds", pa.float64()),
])


def traces_to_table(traces: list[Trace]) -> pa.Table:
    return pa.Table.from_pylist([t.to_row() for t in traces], schema=TRACE_SCHEMA)


def traces_from_table(table: pa.Table) -> list[Trace]:
    return [Trace.from_row(r) for r in table.to_pylist()]
