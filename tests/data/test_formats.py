"""rapidfire_ray.data.formats: row normalisation and oasst tree assembly (pure Python)."""

from __future__ import annotations

import json
import time

import pytest

from rapidfire_ray.data.formats import (
    DROPPED_REASON,
    FORMATS,
    RECORD_KEYS,
    assemble_oasst,
    make_record,
    normalise,
)
from rapidfire_ray.errors import RapidfireError
from record_checks import check_records

FIELD_KEYS = tuple(k for k in RECORD_KEYS if k != "source")


def check_fields(fields: dict) -> dict:
    assert tuple(fields) == FIELD_KEYS
    assert all(type(v) is str for v in fields.values()), fields
    if fields["error"]:
        assert all(fields[k] == "" for k in FIELD_KEYS if k != "error")
    return fields


def norm(obj, fmt):
    return check_fields(normalise(obj, fmt))


def err(obj, fmt):
    fields = norm(obj, fmt)
    assert fields["error"], f"expected an error for {obj!r}"
    return fields["error"]


# ----- general -----------------------------------------------------------------------------


def test_constants():
    assert FORMATS == ("text", "prompt_completion", "messages", "oasst", "preference", "prompt")
    assert RECORD_KEYS == ("source", "error", "text", "prompt", "completion", "messages", "chosen", "rejected",
                           "extra")


def test_unknown_format_is_a_rapidfire_error():
    with pytest.raises(RapidfireError, match=r"data.format 'csv' is not supported.*text"):
        normalise({"text": "x"}, "csv")


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("obj", [[1, 2], "text", 3, None, True])
def test_non_object_row(fmt, obj):
    assert "expected an object" in err(obj, fmt)


def test_make_record_fills_every_key():
    rec = make_record("f.jsonl:3", text="hello")
    assert check_records([rec]) == [
        {"source": "f.jsonl:3", "error": "", "text": "hello", "prompt": "", "completion": "",
         "messages": "", "chosen": "", "rejected": "", "extra": ""}
    ]
    bad = make_record("f.jsonl:4", "boom", text="dropped")
    assert bad["error"] == "boom" and bad["text"] == ""


# ----- text --------------------------------------------------------------------------------


def test_text_good():
    fields = norm({"text": "Hello, wörld", "id": 7}, "text")
    assert fields == {"error": "", "text": "Hello, wörld", "prompt": "", "completion": "",
                      "messages": "", "chosen": "", "rejected": "", "extra": ""}


def test_text_bad():
    assert err({"content": "x"}, "text") == "missing field 'text'"
    assert err({"text": 5}, "text") == "field 'text' must be a string, got int"
    assert err({"text": None}, "text") == "field 'text' must be a string, got null"
    assert err({"text": ["a"]}, "text") == "field 'text' must be a string, got list"
    assert err({"text": "  \n\t"}, "text") == "empty text in 'text'"
    assert err({"text": ""}, "text") == "empty text in 'text'"


def test_lone_surrogate_is_invalid_text():
    obj = json.loads('{"text": "ab\\ud800cd"}')  # json accepts it; UTF-8/Arrow cannot hold it
    assert "invalid text in 'text'" in err(obj, "text")


# ----- prompt_completion -------------------------------------------------------------------


def test_prompt_completion_good():
    fields = norm({"prompt": "What is 2 + 2?", "completion": " 4", "answer": "4"},
                  "prompt_completion")
    assert fields["error"] == ""
    assert (fields["prompt"], fields["completion"]) == ("What is 2 + 2?", " 4")
    assert fields["text"] == fields["messages"] == ""


def test_prompt_completion_bad():
    pc = "prompt_completion"
    assert err({"prompt": "p"}, pc) == "missing field 'completion'"
    assert err({"completion": "c"}, pc) == "missing field 'prompt'"
    assert err({"prompt": 3, "completion": "c"}, pc) == "field 'prompt' must be a string, got int"
    assert err({"prompt": "p", "completion": {"a": 1}}, pc) == (
        "field 'completion' must be a string, got object"
    )
    assert err({"prompt": "p", "completion": " "}, pc) == "empty text in 'completion'"
    assert err({"prompt": "", "completion": "c"}, pc) == "empty text in 'prompt'"


def test_prompt_completion_conversational():
    obj = {
        "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        "completion": [{"role": "assistant", "content": "Hello!", "weight": 1}],
    }
    fields = norm(obj, "prompt_completion")
    assert fields["error"] == "" and fields["prompt"] == fields["completion"] == ""
    assert json.loads(fields["messages"]) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
    ]


def test_prompt_completion_conversational_bad():
    pc = "prompt_completion"
    user = [{"role": "user", "content": "Hi"}]
    assert "field 'completion' must be a list of messages" in err(
        {"prompt": user, "completion": "Hello"}, pc
    )
    assert "field 'prompt' must be a list of messages" in err(
        {"prompt": "Hi", "completion": [{"role": "assistant", "content": "x"}]}, pc
    )
    assert "no assistant message" in err({"prompt": user, "completion": user}, pc)
    assert err({"prompt": [], "completion": user}, pc) == "empty list in 'prompt'"


# ----- messages ----------------------------------------------------------------------------


def test_messages_good():
    msgs = [
        {"role": "system", "content": "You are helpful."},
        {"role": "user", "content": "¿Qué tal? 你好"},
        {"role": "assistant", "content": "Bien.", "name": "bot"},
    ]
    fields = norm({"messages": msgs}, "messages")
    assert fields["error"] == ""
    assert "你好" in fields["messages"]  # ensure_ascii=False
    assert json.loads(fields["messages"]) == [{k: m[k] for k in ("role", "content")} for m in msgs]


@pytest.mark.parametrize(
    "messages, expected",
    [
        ("hello", "field 'messages' must be a list of messages, got str"),
        ([], "empty list in 'messages'"),
        (["hi"], "messages[0] must be an object"),
        ([{"content": "hi"}], "missing field 'messages[0].role'"),
        ([{"role": "user"}], "missing field 'messages[0].content'"),
        (
            [{"role": "user", "content": "hi"}, {"role": "bot", "content": "yo"}],
            "messages[1].role is 'bot'; expected one of system, user, assistant",
        ),
        ([{"role": 1, "content": "hi"}], "messages[0].role is int"),
        (
            [{"role": "user", "content": "hi"}, {"role": "assistant", "content": 5}],
            "field 'messages[1].content' must be a string, got int",
        ),
        ([{"role": "user", "content": "hi"}], "no assistant message with non-empty content"),
        (
            [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "  "}],
            "no assistant message with non-empty content",
        ),
    ],
)
def test_messages_bad(messages, expected):
    assert expected in err({"messages": messages}, "messages")


def test_messages_missing_field():
    assert err({"conversation": []}, "messages") == "missing field 'messages'"


def test_messages_lone_surrogate():
    obj = json.loads(
        '{"messages": [{"role": "user", "content": "x"}, '
        '{"role": "assistant", "content": "\\udc00"}]}'
    )
    assert "invalid text in 'messages[1].content'" in err(obj, "messages")


# ----- oasst -------------------------------------------------------------------------------


def msg(mid, parent, role, text=None, **extra):
    row = {"message_id": mid, "parent_id": parent, "role": role,
           "text": text if text is not None else f"text of {mid}", "lang": "en"}
    row.update(extra)
    return row


def assemble(objs):
    rows = [(f"t.jsonl:{i + 1}", obj) for i, obj in enumerate(objs)]
    return check_records(assemble_oasst(rows))


def convo(rec):
    return [(m["role"], m["content"]) for m in json.loads(rec["messages"])]


def test_oasst_single_row_validation():
    assert norm(msg("a", None, "prompter"), "oasst")["error"] == ""
    assert err(msg("a", None, "user"), "oasst") == (
        "field 'role' is 'user'; expected 'prompter' or 'assistant'"
    )
    assert err({"message_id": "a", "parent_id": None, "role": "prompter"}, "oasst") == (
        "missing field 'text'"
    )
    assert err(msg("a", None, "prompter", deleted=True), "oasst") == DROPPED_REASON
    assert err(msg("a", None, "prompter", review_result=False), "oasst") == DROPPED_REASON
    assert norm(msg("a", None, "prompter", review_result=None), "oasst")["error"] == ""
    assert "field 'parent_id' must be a string" in err(msg("a", 5, "assistant"), "oasst")
    assert "field 'lang' must be a string" in err(msg("a", None, "prompter", lang=1), "oasst")


def test_oasst_branching_tree():
    rows = [
        msg("r", None, "prompter", "Q1"),
        msg("a1", "r", "assistant", "A1"),
        msg("a2", "r", "assistant", "A2"),
        msg("p2", "a1", "prompter", "Q2"),
        msg("a3", "p2", "assistant", "A3"),
        msg("p3", "a3", "prompter", "Q3 (never answered)"),
        msg("p4", "a2", "prompter", "Q4"),
        msg("a4", "p4", "assistant", "A4"),
        msg("a5", "p4", "assistant", "A5"),
        msg("b", None, "prompter", "lonely question"),
    ]
    recs = assemble(rows)
    assert [r["source"] for r in recs] == ["t.jsonl:5", "t.jsonl:8", "t.jsonl:9"]
    assert all(r["error"] == "" for r in recs)
    assert convo(recs[0]) == [
        ("user", "Q1"), ("assistant", "A1"), ("user", "Q2"), ("assistant", "A3")
    ]
    assert convo(recs[1]) == [
        ("user", "Q1"), ("assistant", "A2"), ("user", "Q4"), ("assistant", "A4")
    ]
    assert convo(recs[2])[-1] == ("assistant", "A5")


def test_oasst_children_before_parents():
    rows = [
        msg("a2", "p2", "assistant", "A2"),
        msg("p2", "a1", "prompter", "Q2"),
        msg("a1", "r", "assistant", "A1"),
        msg("r", None, "prompter", "Q1"),
    ]
    recs = assemble(rows)
    assert len(recs) == 1 and recs[0]["source"] == "t.jsonl:1"
    assert [c for _, c in convo(recs[0])] == ["Q1", "A1", "Q2", "A2"]


def test_oasst_deleted_and_failed_review():
    rows = [
        msg("r", None, "prompter", "Q"),
        msg("a1", "r", "assistant", "good"),
        msg("a2", "r", "assistant", "rude", deleted=True),
        msg("a3", "r", "assistant", "wrong", review_result=False),
        msg("p2", "a2", "prompter", "follow-up to a deleted reply"),
        msg("a4", "p2", "assistant", "answer below a deleted reply"),
    ]
    recs = assemble(rows)
    assert [(r["source"], r["error"]) for r in recs] == [
        ("t.jsonl:2", ""),
        ("t.jsonl:3", DROPPED_REASON),
        ("t.jsonl:4", DROPPED_REASON),
        ("t.jsonl:5", f"parent 'a2' is a bad row ({DROPPED_REASON})"),
        ("t.jsonl:6", "parent 'p2' is a bad row"),
    ]
    # a deleted leaf does not turn its parent into a leaf
    assert convo(recs[0]) == [("user", "Q"), ("assistant", "good")]


def test_oasst_deleted_only_reply_leaves_no_conversation():
    recs = assemble([msg("r", None, "prompter"), msg("a", "r", "assistant", deleted=True)])
    assert [r["error"] for r in recs] == [DROPPED_REASON]


def test_oasst_orphan():
    rows = [
        msg("r", None, "prompter"),
        msg("a", "r", "assistant"),
        msg("x", "missing-id", "assistant"),
        msg("y", "x", "prompter"),
    ]
    recs = assemble(rows)
    assert [(r["source"], r["error"]) for r in recs] == [
        ("t.jsonl:2", ""),
        ("t.jsonl:3", "parent_id 'missing-id' not found in this file"),
        ("t.jsonl:4", "parent 'x' is a bad row"),
    ]


def test_oasst_cycles_do_not_hang():
    rows = [
        msg("c1", "c2", "prompter"),
        msg("c2", "c1", "assistant"),
        msg("self", "self", "prompter"),
        msg("d", "c2", "prompter"),  # leads into the cycle
        msg("r", None, "prompter"),
        msg("a", "r", "assistant"),
    ]
    recs = assemble(rows)
    errors = {r["source"]: r["error"] for r in recs}
    assert "cycle" in errors["t.jsonl:1"] and "cycle" in errors["t.jsonl:2"]
    assert errors["t.jsonl:3"] == "parent_id cycle involving message 'self'"
    assert errors["t.jsonl:4"] == "parent 'c2' is a bad row"
    assert errors["t.jsonl:6"] == ""
    assert len(recs) == 5


def test_oasst_big_cycle_and_deep_chain_are_fast():
    n = 20000
    cycle = [msg(f"c{i}", f"c{(i + 1) % n}", "prompter" if i % 2 else "assistant")
             for i in range(n)]
    chain = [msg(f"m{i}", f"m{i - 1}" if i else None, "assistant" if i % 2 else "prompter")
             for i in range(n)]
    t0 = time.perf_counter()
    recs = assemble(cycle + chain)
    assert time.perf_counter() - t0 < 10
    assert sum(1 for r in recs if "cycle" in r["error"]) == n
    good = [r for r in recs if not r["error"]]
    assert len(good) == 1 and len(json.loads(good[0]["messages"])) == n


def test_oasst_structural_errors():
    rows = [
        msg("r", None, "assistant"),  # a root must be a prompter
        msg("p", "r", "prompter"),
        msg("q", None, "prompter"),
        msg("q2", "q", "prompter"),  # roles must alternate
        msg("q", None, "prompter", "duplicate id"),
        msg("z", None, "prompter", ""),  # empty text
        {"message_id": "w", "parent_id": None, "role": "prompter", "text": 3},
        "not an object",
    ]
    recs = assemble(rows)
    errors = [r["error"] for r in recs]
    assert errors[0] == "root message has role 'assistant'; a root must be 'prompter'"
    assert errors[1] == "parent 'r' is a bad row"
    assert errors[2] == "role 'prompter' follows a 'prompter' message; roles must alternate"
    assert errors[3] == "duplicate message_id 'q' (first at t.jsonl:3)"
    assert errors[4] == "empty text in 'text'"
    assert errors[5] == "field 'text' must be a string, got int"
    assert "expected an object" in errors[6]
    assert len(recs) == 7  # q itself is good but ends no assistant path: no record


def test_oasst_extra_fields_and_role_mapping():
    rows = [
        msg("r", None, "prompter", "Hola", message_tree_id="r", rank=None, deleted=False,
            review_result=True, lang="es", emojis={"+1": 2}),
        msg("a", "r", "assistant", "¡Hola!", message_tree_id="r", rank=0, deleted=False,
            review_result=True, lang="es"),
    ]
    recs = assemble(rows)
    assert convo(recs[0]) == [("user", "Hola"), ("assistant", "¡Hola!")]
    assert "¡Hola!" in recs[0]["messages"]


def test_oasst_empty():
    assert assemble_oasst([]) == []
