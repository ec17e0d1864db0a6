"""rapidfire_ray.data.sources: finding data files and parsing them into records (no Ray)."""

from __future__ import annotations

import collections
import importlib.util
import json
import os
from pathlib import Path

import pytest

from rapidfire_ray.data.formats import DROPPED_REASON, RECORD_KEYS
from rapidfire_ray.data.sources import SUPPORTED_SUFFIXES, list_data_files, parse_file
from rapidfire_ray.errors import RapidfireError
from record_checks import check_records

REPO = Path(__file__).resolve().parents[2]
SAMPLES = REPO / "jobs" / "data"


def parse(path, content, fmt):
    return check_records(parse_file(str(path), content, fmt))


def jsonl(*objs) -> bytes:
    return "".join(json.dumps(o, ensure_ascii=False) + "\n" for o in objs).encode()


def touch(path: Path, data: bytes = b"") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


# ----- list_data_files ---------------------------------------------------------------------


def test_supported_suffixes():
    assert SUPPORTED_SUFFIXES == (".jsonl", ".json", ".parquet")


def test_list_single_file_relative(tmp_path, monkeypatch):
    touch(tmp_path / "d.jsonl")
    monkeypatch.chdir(tmp_path)
    assert list_data_files("d.jsonl") == [str(tmp_path / "d.jsonl")]
    assert list_data_files("./d.jsonl") == [str(tmp_path / "d.jsonl")]


def test_list_folder_recursive_sorted_skips_hidden(tmp_path):
    for rel in ["b.parquet", "a.jsonl", "sub/c.json", "sub/deeper/d.JSONL", "README.md",
                "notes.txt", ".hidden.jsonl", ".git/x.jsonl", "_tmp/y.parquet", "_SUCCESS",
                "sub/.cache/z.json"]:
        touch(tmp_path / rel)
    files = list_data_files(str(tmp_path))
    assert files == sorted(files)
    assert [os.path.relpath(f, tmp_path) for f in files] == [
        "a.jsonl", "b.parquet", os.path.join("sub", "c.json"),
        os.path.join("sub", "deeper", "d.JSONL"),
    ]
    assert all(os.path.isabs(f) for f in files)


def test_list_missing_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RapidfireError) as exc:
        list_data_files("nope/data.jsonl")
    msg = str(exc.value)
    assert msg == (
        f"data.path 'nope/data.jsonl' does not exist (resolved to {tmp_path}/nope/data.jsonl); "
        f"point data.path at a .jsonl/.parquet file or a folder of them"
    )
    assert "\n" not in msg


def test_list_empty_folder(tmp_path):
    touch(tmp_path / "readme.md")
    touch(tmp_path / ".hidden.jsonl")
    with pytest.raises(RapidfireError, match="is a folder with no data files") as exc:
        list_data_files(str(tmp_path))
    assert str(tmp_path) in str(exc.value) and "\n" not in str(exc.value)


def test_list_unsupported_suffix(tmp_path):
    touch(tmp_path / "data.csv")
    with pytest.raises(RapidfireError) as exc:
        list_data_files(str(tmp_path / "data.csv"))
    msg = str(exc.value)
    assert "'.csv'" in msg and ".jsonl, .json, .parquet" in msg and "\n" not in msg
    touch(tmp_path / "noext")
    with pytest.raises(RapidfireError, match="no suffix"):
        list_data_files(str(tmp_path / "noext"))


def test_list_empty_path():
    with pytest.raises(RapidfireError, match="data.path is empty"):
        list_data_files("")


# ----- parse_file: JSONL -------------------------------------------------------------------


def test_jsonl_row_numbers_with_blank_lines():
    content = (
        b'{"text": "one"}\n'
        b"\n"
        b"   \n"
        b'{"text": "four"}\r\n'
        b"\r\n"
        b'{"text": "six"}'  # no trailing newline
    )
    recs = parse("/data/t.jsonl", content, "text")
    assert [(r["source"], r["error"], r["text"]) for r in recs] == [
        ("t.jsonl:1", "", "one"),
        ("t.jsonl:4", "", "four"),
        ("t.jsonl:6", "", "six"),
    ]


def test_jsonl_bad_rows_each_kind():
    lines = [
        b'{"prompt": "p", "completion": "c"}',
        b'{"prompt": "p"}',  # missing field
        b'{"prompt": 1, "completion": "c"}',  # wrong type
        b'{"prompt": "p", "completion": "   "}',  # empty text
        '{"prompt": "caf\u00e9", "completion": "c"}'.encode("latin-1"),  # invalid UTF-8
        b'{"prompt": "p", "completion": ',  # invalid JSON
        b'["p", "c"]',  # not an object
        b'{"prompt": "\\ud83d", "completion": "c"}',  # lone surrogate
        b"",
        b'{"prompt": "p2", "completion": "c2"}',
    ]
    recs = parse("x/pc.jsonl", b"\n".join(lines) + b"\n", "prompt_completion")
    got = [(r["source"], r["error"]) for r in recs]
    assert got[0] == ("pc.jsonl:1", "")
    assert got[1] == ("pc.jsonl:2", "missing field 'completion'")
    assert got[2] == ("pc.jsonl:3", "field 'prompt' must be a string, got int")
    assert got[3] == ("pc.jsonl:4", "empty text in 'completion'")
    assert got[4][0] == "pc.jsonl:5" and got[4][1].startswith("invalid UTF-8")
    assert got[5][0] == "pc.jsonl:6" and got[5][1].startswith("invalid JSON: ")
    assert got[6] == ("pc.jsonl:7", "row is a JSON list, expected an object")
    assert got[7][0] == "pc.jsonl:8" and "invalid text in 'prompt'" in got[7][1]
    assert got[8] == ("pc.jsonl:10", "")
    assert (recs[8]["prompt"], recs[8]["completion"]) == ("p2", "c2")
    assert len(recs) == 9


def test_jsonl_utf8_bom_and_non_ascii():
    content = "\ufeff" + '{"text": "naïve café 日本"}\n'
    recs = parse("bom.jsonl", content.encode("utf-8"), "text")
    assert [(r["error"], r["text"]) for r in recs] == [("", "naïve café 日本")]


def test_json_suffix_is_json_lines():
    recs = parse("a.json", jsonl({"text": "x"}, {"text": "y"}), "text")
    assert [r["text"] for r in recs] == ["x", "y"]


def test_whole_file_json_document_is_one_error():
    doc = json.dumps([{"text": "x"}, {"text": "y"}], indent=2).encode()
    recs = parse("dir/arr.json", doc, "text")
    assert len(recs) == 1 and recs[0]["source"] == "arr.json"
    assert "JSON array spread over several lines, not JSON Lines" in recs[0]["error"]
    obj = json.dumps({"text": "x"}, indent=2).encode()
    recs = parse("obj.jsonl", obj, "text")
    assert len(recs) == 1 and "JSON object spread over several lines" in recs[0]["error"]
    # a one-line array is a JSON Lines file whose row is not an object
    recs = parse("one.jsonl", b'[{"text": "x"}]\n', "text")
    assert recs[0]["source"] == "one.jsonl:1" and "expected an object" in recs[0]["error"]


def test_empty_file():
    assert parse("e.jsonl", b"", "text") == []
    assert parse("e.jsonl", b"\n\n  \n", "messages") == []


def test_messages_jsonl():
    row = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]}
    bad = {"messages": [{"role": "robot", "content": "Hi"}]}
    recs = parse("m.jsonl", jsonl(row, bad), "messages")
    assert json.loads(recs[0]["messages"]) == row["messages"]
    assert recs[1]["source"] == "m.jsonl:2" and "role is 'robot'" in recs[1]["error"]


def test_parse_file_rejects_unknown_format_and_suffix():
    with pytest.raises(RapidfireError, match="data.format 'chat'"):
        parse_file("a.jsonl", b"", "chat")
    with pytest.raises(RapidfireError, match=r"unsupported suffix '\.csv'"):
        parse_file("a.csv", b"text\nx\n", "text")


# ----- parse_file: Parquet -----------------------------------------------------------------


def parquet_bytes(tmp_path, table) -> bytes:
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "t.parquet"
    pq.write_table(table, path, row_group_size=2)  # several row groups
    return path.read_bytes()


def test_parquet_prompt_completion(tmp_path):
    pa = pytest.importorskip("pyarrow")
    table = pa.table({
        "id": [1, 2, 3, 4, 5],
        "prompt": ["p1", None, "p3", "p4", "p5"],
        "completion": ["c1", "c2", "", "c4", "c5"],
        "extra": [b"x"] * 5,
    })
    recs = parse("/some/dir/t.parquet", parquet_bytes(tmp_path, table), "prompt_completion")
    assert [(r["source"], r["error"]) for r in recs] == [
        ("t.parquet:1", ""),
        ("t.parquet:2", "field 'prompt' must be a string, got null"),
        ("t.parquet:3", "empty text in 'completion'"),
        ("t.parquet:4", ""),
        ("t.parquet:5", ""),
    ]
    assert (recs[4]["prompt"], recs[4]["completion"]) == ("p5", "c5")


def test_parquet_wrong_types_and_missing_columns(tmp_path):
    pa = pytest.importorskip("pyarrow")
    table = pa.table({"text": [1, 2], "other": ["a", "b"]})
    recs = parse("n.parquet", parquet_bytes(tmp_path, table), "text")
    assert [r["error"] for r in recs] == ["field 'text' must be a string, got int"] * 2
    recs = parse("n.parquet", parquet_bytes(tmp_path, table), "messages")
    assert [(r["source"], r["error"]) for r in recs] == [
        ("n.parquet:1", "missing field 'messages'"),
        ("n.parquet:2", "missing field 'messages'"),
    ]


def test_parquet_messages_list_of_structs(tmp_path):
    pa = pytest.importorskip("pyarrow")
    conv = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    table = pa.table({"messages": [conv, conv[:1], []]})
    recs = parse("m.parquet", parquet_bytes(tmp_path, table), "messages")
    assert json.loads(recs[0]["messages"]) == conv
    assert "no assistant message" in recs[1]["error"]
    assert recs[2]["error"] == "empty list in 'messages'"


def test_parquet_corrupt(tmp_path):
    pa = pytest.importorskip("pyarrow")
    recs = parse("dir/bad.parquet", b"this is not parquet at all", "text")
    assert len(recs) == 1 and recs[0]["source"] == "bad.parquet"
    assert recs[0]["error"].startswith("not a readable Parquet file")
    good = parquet_bytes(tmp_path, pa.table({"text": ["a"] * 10}))
    recs = parse("cut.parquet", good[: len(good) // 2], "text")
    assert recs[-1]["source"] == "cut.parquet"
    assert recs[-1]["error"].startswith("not a readable Parquet file")
    assert parse("empty.parquet", b"", "text")[0]["source"] == "empty.parquet"


def test_parquet_oasst(tmp_path):
    pa = pytest.importorskip("pyarrow")
    rows = [
        {"message_id": "r", "parent_id": None, "role": "prompter", "text": "Q", "lang": "en",
         "deleted": False, "review_result": True, "rank": None},
        {"message_id": "a", "parent_id": "r", "role": "assistant", "text": "A", "lang": "en",
         "deleted": False, "review_result": True, "rank": 0},
        {"message_id": "b", "parent_id": "r", "role": "assistant", "text": "B", "lang": "en",
         "deleted": True, "review_result": True, "rank": 1},
    ]
    recs = parse("o.parquet", parquet_bytes(tmp_path, pa.Table.from_pylist(rows)), "oasst")
    assert [(r["source"], r["error"]) for r in recs] == [
        ("o.parquet:2", ""),
        ("o.parquet:3", DROPPED_REASON),
    ]


# ----- parse_file: oasst JSONL -------------------------------------------------------------


def test_oasst_jsonl_decode_errors_keep_file_order():
    content = b"\n".join([
        b'{"message_id": "a", "parent_id": "r", "role": "assistant", "text": "A", "lang": "en"}',
        b"{oops",
        b'{"message_id": "r", "parent_id": null, "role": "prompter", "text": "Q", "lang": "en"}',
        b"",
        b'{"message_id": "o", "parent_id": "gone", "role": "assistant", "text": "x"}',
        b"\xff",
    ])
    recs = parse("o.jsonl", content, "oasst")
    assert [(r["source"], r["error"][:12]) for r in recs] == [
        ("o.jsonl:1", ""),
        ("o.jsonl:2", "invalid JSON"),
        ("o.jsonl:5", "parent_id 'g"),
        ("o.jsonl:6", "invalid UTF-"),
    ]


# ----- the committed sample files ----------------------------------------------------------


def test_sft_sample_parses_clean():
    path = SAMPLES / "sft_sample.jsonl"
    recs = parse(path, path.read_bytes(), "prompt_completion")
    assert len(recs) == 600
    assert [r["error"] for r in recs if r["error"]] == []
    assert [r["source"] for r in recs[:2]] == ["sft_sample.jsonl:1", "sft_sample.jsonl:2"]
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    assert len({r["id"] for r in rows}) == len(rows)
    tasks = collections.Counter(r["task"] for r in rows)
    assert len(tasks) >= 8 and min(tasks.values()) >= 20
    for r in rows:
        assert set(r) == {"id", "task", "prompt", "completion", "answer"}
        assert r["completion"] == r["answer"] or r["completion"].endswith(
            f"The answer is {r['answer']}."
        ), r["id"]


def test_sft_sample_matches_its_generator():
    spec = importlib.util.spec_from_file_location("make_sft_sample", SAMPLES / "make_sft_sample.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    expected = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in mod.make_rows())
    assert (SAMPLES / "sft_sample.jsonl").read_text(encoding="utf-8") == expected


def test_oasst_sample_only_the_deleted_message_is_bad():
    path = SAMPLES / "oasst_sample.jsonl"
    recs = parse(path, path.read_bytes(), "oasst")
    bad = [r for r in recs if r["error"]]
    assert [r["error"] for r in bad] == [DROPPED_REASON]
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    deleted = [i + 1 for i, r in enumerate(rows) if r["deleted"]]
    assert [r["source"] for r in bad] == [f"oasst_sample.jsonl:{i}" for i in deleted]
    good = [r for r in recs if not r["error"]]
    assert len(good) == 20
    for rec in good:
        msgs = json.loads(rec["messages"])
        assert msgs[0]["role"] == "user" and msgs[-1]["role"] == "assistant"
        assert [m["role"] for m in msgs] == ["user", "assistant"] * (len(msgs) // 2)
    assert 40 <= len(rows) <= 60
    assert len({r["message_tree_id"] for r in rows}) >= 12
    assert {r["lang"] for r in rows} >= {"en", "es", "de", "fr"}


def test_records_are_arrow_friendly():
    pa = pytest.importorskip("pyarrow")
    path = SAMPLES / "oasst_sample.jsonl"
    recs = parse(path, path.read_bytes(), "oasst")
    recs += parse("x.jsonl", b'{"text": 1}\n{"text": "ok"}\n', "text")
    table = pa.Table.from_pylist(recs)
    assert table.schema.names == list(RECORD_KEYS)
    assert all(t == pa.string() for t in table.schema.types)
