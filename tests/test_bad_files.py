"""Bad data files (issue 37): each one a line naming the file, the line or row and the problem, before Ray
(exit 2); never a traceback, never loaded into memory whole, never trained as the text "None"."""

from __future__ import annotations

import json
import tracemalloc

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from sliderl.cluster.cli import main
from sliderl.cluster.config.sft import SFTJobConfig
from sliderl.cluster.errors import ConfigError
from sliderl.cluster.run.sft_job import keep_fitting_examples, stage_pairs
from sliderl.cluster.storage.data_files import check_data_files
from sliderl.trainer.sft import SFTExample

GOOD = [{"prompt": "1 + 1 =", "answer": "2"}, {"prompt": "2 + 2 =", "answer": "4"}]


def jsonl(rows) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def zero_rows(path) -> None:
    pq.write_table(pa.table({"prompt": pa.array([], pa.string()), "answer": pa.array([], pa.string())}), path)


# name -> (file name, how it is written, words the one line must hold besides the file's path)
BAD_FILES = {
    "empty JSONL": ("d.jsonl", lambda p: p.write_bytes(b""), ["has no rows (it is empty)"]),
    "0-row Parquet": ("d.parquet", zero_rows, ["has no rows (a Parquet file of 0 rows)"]),
    "UTF-16": ("d.jsonl", lambda p: p.write_bytes(jsonl(GOOD).decode().encode("utf-16")), ["is UTF-16", "as UTF-8"]),
    "invalid UTF-8": ("d.jsonl", lambda p: p.write_bytes(jsonl(GOOD[:1]) + b'{"prompt": "3\xff", "answer": "1"}\n'),
                      ["line 2 is not valid UTF-8 (byte 0xff at byte 14 of the line)"]),
    "an object where a text was": ("d.jsonl",
                                   lambda p: p.write_bytes(jsonl([*GOOD, {"prompt": "x", "answer": {"a": 3}}])),
                                   ["line 3: field 'answer' is an object", "where d.jsonl line 1 has a text"]),
    "a number where a text was": ("d.jsonl", lambda p: p.write_bytes(jsonl([GOOD[0], {"prompt": "x", "answer": 4}])),
                                  ["line 2: field 'answer' is a number (4)", "has a text"]),
    "a line that is no object": ("d.jsonl", lambda p: p.write_bytes(jsonl(GOOD) + b"[1, 2]\n"),
                                 ["line 3 is a JSON list, not an object"]),
    "a line that is no JSON": ("d.jsonl", lambda p: p.write_bytes(jsonl(GOOD) + b'{"prompt": "x",\n'),
                               ["line 3 is not valid JSON"]),
    "a line over the bound": ("d.jsonl",
                              lambda p: p.write_bytes(jsonl([GOOD[0], {"prompt": "x" * 3000, "answer": "1"}])),
                              ["line 2 is longer than data.max_line_bytes=1000 bytes, so it was not loaded"]),
}


@pytest.mark.parametrize("case", BAD_FILES)
def test_a_bad_data_file_is_one_line_naming_file_line_and_problem_before_ray(case, tmp_path, capsys):
    # Catches (issue 37): each of these was a traceback from inside datasets/pyarrow (StopIteration, "BatchSize
    # must be greater than 0", "JSON parse error ... in row 0", a UnicodeDecodeError naming no file), or worse
    # was loaded: {"a": 3} became the answer text "{'a': 3}", a 3 KB line was read whole. Planted by dropping
    # check_data_files from storage.data.open_dataset, every case fails (a traceback, or no error at all).
    import ray

    name, write, fragments = BAD_FILES[case]
    source = tmp_path / name
    write(source)
    code = main(["train", "task.type=math", f"data.source={source}", "warmstart.enabled=false", "eval.before=false",
                 "eval.after=false", "data.max_line_bytes=1000", f"run_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith("sliderl train: error:"), err
    assert str(source) in err and all(f in err for f in fragments), err
    assert not ray.is_initialized()


def test_an_empty_eval_source_is_named(tmp_path, capsys):
    # Catches (issue 37): an empty data.eval_source failing with a bare StopIteration once the eval loads it.
    train, held_out = tmp_path / "train.jsonl", tmp_path / "eval.jsonl"
    train.write_bytes(jsonl(GOOD))
    held_out.write_bytes(b"")
    code = main(["train", "task.type=math", f"data.source={train}", f"data.eval_source={held_out}",
                 "data.eval_split=train", "warmstart.enabled=false", f"run_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert code == 2 and f"data file {held_out} has no rows" in err and err.count("\n") == 1, err


def test_a_50_mb_line_is_refused_without_being_loaded(tmp_path):
    # Catches (issue 37): one 50 MB line loaded by datasets took 19.5 GB. The check reads at most the bound
    # (4 MiB by default) + 1 byte of a line (a buffered readline holds that twice while it copies): its peak
    # Python allocation stays under 3 x 4 MiB. Planted by reading each line whole (readline() without the
    # bound), the peak is over 50 MB and this fails.
    source = tmp_path / "huge.jsonl"
    with open(source, "wb") as f:
        f.write(jsonl(GOOD[:1]))
        f.write(b'{"prompt": "' + b"7" * (50 * 2**20) + b'", "answer": "1"}\n')
    tracemalloc.start()
    try:
        with pytest.raises(ConfigError, match=r"huge.jsonl line 2 is longer than data.max_line_bytes=4194304 bytes"):
            check_data_files(str(source))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 12 * 2**20, peak


def test_good_files_pass_the_check(tmp_path):
    # The check refuses nothing datasets reads correctly: a UTF-8 byte-order mark, CRLF line ends, blank lines,
    # null for a missing value, numbers of both kinds, a .json array, a folder of Parquet parts.
    (tmp_path / "bom.jsonl").write_bytes(b"\xef\xbb\xbf" + jsonl(GOOD).replace(b"\n", b"\r\n\r\n"))
    (tmp_path / "nulls.jsonl").write_bytes(jsonl([{"prompt": "a", "answer": None, "n": 1}, {"prompt": "b", "n": 2.5}]))
    (tmp_path / "array.json").write_text("[\n" + ",\n".join(json.dumps(r) for r in GOOD) + "\n]\n")
    (tmp_path / "parts").mkdir()
    for i in range(2):
        pq.write_table(pa.Table.from_pylist(GOOD), tmp_path / "parts" / f"part-{i}.parquet")
    for name in ("bom.jsonl", "nulls.jsonl", "array.json", "parts"):
        check_data_files(str(tmp_path / name))


# ------------------------------------------------------------------------------------------------------------ SFT


def sft_config(tmp_path, rows, *overrides) -> SFTJobConfig:
    from sliderl.cluster.config.base import load_config

    source = tmp_path / "pairs.jsonl"
    source.write_bytes(jsonl(rows))
    return load_config(SFTJobConfig, None, [f"data.source={source}", "data.held_out=1", *overrides])


PAIRS = [{"prompt": "a", "completion": "b"}, {"prompt": "c", "completion": None}, {"prompt": "e", "completion": "f"},
         {"prompt": "g", "completion": "h"}]


def test_a_null_sft_completion_is_refused_or_skipped_and_counted(tmp_path, capsys):
    # Catches (issue 37): a null completion trained as the text "None" (str(None)). Planted by turning the row
    # into str(prompt), str(completion) again, no error is raised and "None" is a completion.
    cfg = sft_config(tmp_path, PAIRS)
    with pytest.raises(ConfigError, match=r"pairs.jsonl' row 1 has no completion \(got None\).*data.skip_invalid=true"):
        stage_pairs(cfg, cfg.task)
    train, held_out = stage_pairs(sft_config(tmp_path, PAIRS, "data.skip_invalid=true"), cfg.task)
    assert train + held_out == [("a", "b"), ("e", "f"), ("g", "h")]
    assert "left out 1 rows of SFT data" in capsys.readouterr().out


class CharTokenizer:
    """One token per character, a BOS first: lengths worked out by hand."""

    def __call__(self, texts, add_special_tokens=True):
        ids = lambda t: ([0] if add_special_tokens else []) + [ord(c) for c in t]  # noqa: E731
        return type("Encoded", (), {"input_ids": [ids(t) for t in texts] if isinstance(texts, list) else ids(texts)})


def test_sft_examples_longer_than_the_context_are_refused_or_skipped(capsys):
    # Catches (issue 37): SFT prompts longer than the model's context kept and trained. Context 40: "p"*30 + "c"*5
    # is 1 (BOS) + 30 + 5 + 1 (eos) = 37 tokens and fits; "p"*30 + "c"*9 is 41 and does not; a chat prompt of 39
    # ids + "c" is 39 + 1 + 1 = 41 and does not. Planted by comparing the prompt alone with the context, the
    # second example is kept and this fails.
    fits, long_completion = SFTExample("p" * 30, "c" * 5), SFTExample("p" * 30, "c" * 9)
    long_chat = SFTExample("chat", "c", tuple(range(39)))
    parts = ([fits, long_completion, fits], [long_chat])
    with pytest.raises(ConfigError, match=r"row 1: prompt \+ completion is 41 tokens, longer than the model's context "
                                          r"of 40.*data.skip_invalid=true"):
        keep_fitting_examples(parts, CharTokenizer(), 40, False, "pairs.jsonl")
    assert keep_fitting_examples(parts, CharTokenizer(), 40, True, "pairs.jsonl") == ([fits, fits], [])
    assert "left out 2 SFT examples of 'pairs.jsonl' longer than the context of 40 tokens (first: row 1, 41 tokens)" \
        in capsys.readouterr().out


def test_an_sft_output_dir_that_is_a_file_is_one_line(tmp_path, capsys):
    # Catches (issue 37): output_dir naming a file ended in a NotADirectoryError traceback when config.yaml was
    # written. Planted by dropping check_writable_folder from cli.run_sft, the traceback comes back.
    blocker = tmp_path / "out"
    blocker.write_text("")
    source = tmp_path / "pairs.jsonl"
    source.write_bytes(jsonl([{"prompt": f"say {i}", "completion": str(i)} for i in range(8)]))
    code = main(["sft", f"data.source={source}", "data.held_out=2", f"model.cache_dir={tmp_path / 'models'}",
                 "model.hidden_size=32", "model.num_layers=1", "model.num_heads=2", "model.num_kv_heads=1",
                 "model.intermediate_size=64", f"output_dir={blocker}"])
    err = capsys.readouterr().err
    assert code == 2 and f"output_dir='{blocker}' is a file, not a folder" in err.strip().splitlines()[-1], err
