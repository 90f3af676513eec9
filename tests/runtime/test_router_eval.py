"""`qse router-eval` end to end: the live conductor journals router answers and parks its sessions at a planned
stop; router-eval asks the questions again offline over the parked ids, with the live question (the control:
every answer agrees) and with three classes through a mapping."""

import json

import pytest
from runtime_rig import GRID, prompt_ids

from qse.cli import main
from qse.runtime.conductor import GenerateRequest, ShadowOptions
from qse.runtime.router import ROUTER_CLASSES, ROUTER_QUESTION
from qse.shadow.router_eval import Question, RouterEvalError, parse_mapping, question_ids, read_journal
from qse.store.store import ShadowStore

# two sessions' turns: (session, the served router's class); the router's class changes on turns 3 and 5
TURNS = [("a", "code_edit"), ("a", "code_edit"), ("a", "chat"), ("b", "debug"), ("b", "explain")]


@pytest.fixture
async def journaled(make_rig, tmp_path):
    """A conductor that answered the router's question on five turns, then stopped (parking every session)."""
    disk_dir = tmp_path / "disk"
    store = ShadowStore(64 << 20, disk_dir)
    rig = make_rig(options=ShadowOptions(router="shadow", router_min_tokens=64), residency=store)
    c = rig.conductor
    im_end = c.served.chat.turn_end_id
    held = {"a": [], "b": []}
    for n, (sid, router_label) in enumerate(TURNS):
        prompt = held[sid] + prompt_ids(2 * GRID + 9 + 5 * n, start=2000 + 300 * n)
        prompt[len(held[sid]) + 7] = im_end  # the question goes just past it, inside the turn's new ids
        req = GenerateRequest(prompt_ids=prompt, max_tokens=3, session_id=sid, router_label=router_label)
        req.request_id = f"r{n}"
        out = [t async for t in c.generate(req)]
        held[sid] = prompt + out
        while await c.idle_once():  # the reader reaches the question and answers it
            pass
    await c.stop()
    return tmp_path / "shadow", disk_dir


def _router_eval(capsys, journal, disk_dir, *extra) -> dict:
    code = main(["router-eval", "--journal", str(journal), "--sessions", str(disk_dir), "--model", "",
                 "--device", "cpu", "--dtype", "float32", "--grid", str(GRID), *extra])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return json.loads(captured.out)


async def test_the_live_question_asked_again_agrees_with_every_live_answer(journaled, capsys):
    journal, disk_dir = journaled
    entries = read_journal(journal)
    assert [(e.session, e.request_id, e.router_label) for e in entries] == [
        (sid, f"r{n}", label) for n, (sid, label) in enumerate(TURNS)]
    report = _router_eval(capsys, journal, disk_dir)
    assert report["parked_files"] == 2 and report["questions"] == 5 and report["skipped"] == {}
    assert report["question"] == ROUTER_QUESTION and report["classes"] == ROUTER_CLASSES
    assert report["vs_live"] == {"n": 5, "agree": 5, "rate": 1.0}  # the control: the reader is exact
    answers = report["answers"]
    assert [a["position"] for a in answers] == [e.position for e in entries]
    assert [a["label"] for a in answers] == [e.label for e in entries]
    agree = sum(a["label"] == a["router_label"] for a in answers)
    assert report["vs_router"] == {"n": 5, "agree": agree, "rate": round(agree / 5, 6)}
    # fresh: turns 3 (code_edit -> chat) and 5 (debug -> explain)
    assert [a["is_fresh"] for a in answers] == [False, False, True, False, True]
    assert report["fresh"]["vs_router"]["n"] == 2
    # the constant baseline: always code_edit, the most common router class (2 of 5; on the fresh turns 0 of 2)
    assert report["constant_baseline"] == {"class": "code_edit", "n": 5, "agree": 2, "rate": 0.4}
    assert report["fresh"]["constant_baseline"] == {"n": 2, "agree": 0, "rate": 0.0}


async def test_another_question_of_three_classes_through_a_mapping(journaled, capsys):
    journal, disk_dir = journaled
    mapping = "code_edit=code,debug=code,test=code,chat=chat,*=other"
    report = _router_eval(capsys, journal, disk_dir, "--classes", "code,chat,other", "--map", mapping)
    assert report["classes"] == ["code", "chat", "other"] and report["questions"] == 5
    assert report["question"].endswith("Classes: A) code; B) chat; C) other. Answer with the letter only.")
    assert [a["router_label"] for a in report["answers"]] == ["code", "code", "chat", "code", "other"]
    assert all(a["label"] in ("code", "chat", "other") for a in report["answers"])
    assert report["constant_baseline"]["class"] == "code" and report["constant_baseline"]["agree"] == 3
    assert report["vs_live"]["n"] == 5  # the live answers mapped into the three classes


def test_the_default_question_is_the_live_one_and_its_ids_are_the_conductor_s(tiny_engine):
    question = Question.listing(ROUTER_QUESTION.split(" Classes: ")[0], ROUTER_CLASSES)
    assert question.text == ROUTER_QUESTION
    live = (f"<|im_start|>user\n{ROUTER_QUESTION}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert question_ids(tiny_engine.chat, question) == tiny_engine.chat.tokenizer.encode(live)


def test_bad_input_is_named(tmp_path, capsys):
    with pytest.raises(RouterEvalError, match="mapping entry 'code' must be from=to"):
        parse_mapping("code")
    with pytest.raises(RouterEvalError, match="2 to 26 classes"):
        Question("Which?", ("one",))
    with pytest.raises(RouterEvalError, match="no journal at"):
        read_journal(tmp_path)
    (tmp_path / "shadow.jsonl").write_text('{"session": "a", "position": 5, "label": "chat"}\nnot json\n')
    with pytest.raises(RouterEvalError, match=r"shadow.jsonl:2: not valid JSON"):
        read_journal(tmp_path)
    assert main(["router-eval", "--journal", str(tmp_path), "--sessions", str(tmp_path), "--question", "Which?"]) == 2
    assert "--question needs --classes" in capsys.readouterr().err


async def test_another_reader_from_a_checkpoint_dir(journaled, capsys, tmp_path):
    """Another model's weights (the embedded shape, another seed) answer the same questions at the same places."""
    from qse.models.qwen3_5.config import parse_config
    from qse.models.qwen3_5.presets import embedded_config_dict, random_tensors, write_checkpoint

    journal, disk_dir = journaled
    other = tmp_path / "other-reader"
    config = embedded_config_dict()
    write_checkpoint(other, config, random_tensors(parse_config(config), seed=7))
    report = _router_eval(capsys, journal, disk_dir, "--model", str(other))
    assert report["model"] == "other-reader" and report["questions"] == 5
    assert [a["position"] for a in report["answers"]] == [e.position for e in read_journal(journal)]
    assert report["vs_live"]["n"] == 5 and report["vs_router"]["n"] == 5


async def test_an_unreadable_parked_file_is_counted_and_its_questions_skipped(journaled, capsys):
    journal, disk_dir = journaled
    files = sorted(disk_dir.glob("*.safetensors"))
    files[0].write_bytes(files[0].read_bytes()[:100])  # torn
    report = _router_eval(capsys, journal, disk_dir)
    assert report["parked_files"] == 1 and report["file_misses"] == {"truncated": 1}
    assert report["questions"] + report["skipped"]["no_parked_file"] == 5
