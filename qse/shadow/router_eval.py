"""`qse router-eval`: the journaled router questions asked again, offline, by another reader or as another question.

The live reader answers the router's class question in shadow mode at each long turn's insertion point and
journals it (`<journal dir>/shadow.jsonl`: session, position, label, router_label, ...). A planned stop parks
every session in one file (qse/store/disk.py), ids included; the caller reads the ids (`qse router-eval` does). Here each journaled question is asked again over
the parked ids, at the same position and on the same grid as the live reader asked it (the reader stands on
the grid line at or below the position; the rest is read on the fork), by whatever reader and question are
given: a larger model, a checkpoint, three classes instead of nine.

The report (one JSON object):
    vs_router           agreement with the served router's own class (journal: router_label)
    vs_live             agreement with the live reader's answer (journal: label): the control; the live reader
                        and question asked again agree on every question (the reader is exact)
    fresh               the turns whose router class changed from the session's turn before: where a router
                        earns its keep (a class that never changes is the constant's)
    constant_baseline   always answering the router's most common class
`mapping` sends the journal's classes (router_label and label) to the question's classes before any comparison
(for example code_edit=code, debug=code, *=other); a class it cannot map leaves that entry out of the comparison.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterable

from .reader import ShadowError, ShadowReader

JOURNAL_NAME = "shadow.jsonl"


class RouterEvalError(ShadowError):
    """Bad input to router-eval (a journal line, a class list, a mapping)."""


@dataclass(frozen=True)
class JournalEntry:
    """One live answer of the router's question, as the conductor journaled it."""

    session: str
    position: int  # where the question was inserted (the prompt's last turn end): the answer is over ids[:position]
    label: str  # the live reader's class
    router_label: str | None  # the served router's own class, where a proxy passed it
    request_id: str | None = None


@dataclass(frozen=True)
class Question:
    text: str
    classes: tuple[str, ...]  # the answer letters are A, B, C, ... in this order

    def __post_init__(self) -> None:
        if not self.text.strip():
            raise RouterEvalError("the question is empty")
        if not 2 <= len(self.classes) <= 26:
            raise RouterEvalError(f"a question needs 2 to 26 classes, got {len(self.classes)}: {list(self.classes)}")
        if len(set(self.classes)) != len(self.classes) or not all(c.strip() for c in self.classes):
            raise RouterEvalError(f"classes must be distinct non-empty names, got {list(self.classes)}")

    @property
    def letters(self) -> list[str]:
        return [chr(65 + i) for i in range(len(self.classes))]

    @classmethod
    def listing(cls, instruction: str, classes: Iterable[str]) -> "Question":
        """The router question's shape: an instruction, then 'A) class; B) class; ...', letter only."""
        classes = tuple(classes)
        listed = "; ".join(f"{chr(65 + i)}) {c}" for i, c in enumerate(classes))
        return cls(f"{instruction} Classes: {listed}. Answer with the letter only.", classes)


def question_ids(chat, question: Question) -> list[int]:
    """The question as the reader is asked it: one user turn in the model's chat format, the assistant's turn
    opened with an empty thought (the live conductor's rendering, through the chat template)."""
    return chat.question_ids(question.text)


def read_journal(path: Path | str) -> list[JournalEntry]:
    """The router answers of a journal (a file, or the dir holding shadow.jsonl), in the journal's order.
    Lines of other kinds are passed over; a line that is not JSON is an error naming it."""
    path = Path(path)
    if path.is_dir():
        path = path / JOURNAL_NAME
    if not path.is_file():
        raise RouterEvalError(f"no journal at {path}: give the shadow journal (shadow.jsonl) or its directory")
    entries = []
    for lineno, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise RouterEvalError(f"{path}:{lineno}: not valid JSON ({exc})") from None
        if not isinstance(obj, dict) or not {"session", "position", "label"} <= obj.keys():
            continue
        position = obj["position"]
        if not isinstance(position, int) or isinstance(position, bool) or position < 0:
            raise RouterEvalError(f"{path}:{lineno}: position {position!r} is not a row number")
        entries.append(JournalEntry(str(obj["session"]), position, str(obj["label"]),
                                    obj.get("router_label") or None, obj.get("request_id")))
    return entries


def parse_mapping(spec: str | None) -> dict[str, str]:
    """'from=to,from=to,*=to' -> a dict ('*': every class not named)."""
    if not spec:
        return {}
    out = {}
    for part in spec.split(","):
        if part.count("=") != 1 or not all(s.strip() for s in part.split("=")):
            raise RouterEvalError(f"mapping entry {part!r} must be from=to (for example code_edit=code or *=other)")
        key, value = (s.strip() for s in part.split("="))
        out[key] = value
    return out


def _mapped(label: str | None, mapping: dict[str, str], classes: tuple[str, ...]) -> str | None:
    """A journal class in the question's classes, or None where it cannot be compared."""
    if label is None:
        return None
    if mapping:
        label = mapping.get(label, mapping.get("*"))
    return label if label in classes else None


@dataclass
class Answer:
    session: str
    request_id: str | None
    position: int
    label: str  # this reader's class
    probability: float
    live_label: str | None  # the journal's live class, mapped into the question's classes
    router_label: str | None  # the router's class, mapped
    is_fresh: bool


def _rate(pairs: list[tuple[str, str | None]]) -> dict[str, Any]:
    """{n, agree, rate} over (answer, reference) pairs whose reference is known."""
    known = [(a, r) for a, r in pairs if r is not None]
    agree = sum(a == r for a, r in known)
    return {"n": len(known), "agree": agree, "rate": round(agree / len(known), 6) if known else None}


def evaluate(reader: ShadowReader, question: Question, question_ids: list[int], entries: list[JournalEntry],
             ids_of: dict[str, list[int]], mapping: dict[str, str] | None = None) -> dict[str, Any]:
    """Ask `question` again at every journaled position over the parked ids; the report (module docstring)."""
    mapping = mapping or {}
    grid = reader.grid
    skipped: Counter = Counter()
    answers: list[Answer] = []
    by_session: dict[str, list[JournalEntry]] = {}
    for e in entries:
        by_session.setdefault(e.session, []).append(e)
    for sid, items in by_session.items():
        ids = ids_of.get(sid)
        if ids is None:
            skipped["no_parked_file"] += len(items)
            continue
        # fresh: the router's class changed from the session's turn before (journal order is turn order)
        previous: str | None = None
        fresh: dict[int, bool] = {}
        for i, e in enumerate(items):
            fresh[i] = previous is not None and e.router_label is not None and e.router_label != previous
            previous = e.router_label if e.router_label is not None else previous
        key = f"router-eval:{sid}"
        reader.feed(key, ids)
        session = reader.get(key)
        try:
            for i, e in sorted(enumerate(items), key=lambda ie: ie[1].position):
                if e.position > len(ids) or e.position == 0:
                    skipped["past_parked_ids" if e.position else "empty_prefix"] += 1
                    continue
                # in position order the reader never stands past a question's line
                while session.committed + grid <= e.position:  # the live reader stood on this line
                    reader.read_step(key)
                result = reader.ask(key, question_ids, question.letters, upto=e.position)
                label = question.classes[question.letters.index(result.label)]
                answers.append(Answer(sid, e.request_id, e.position, label, round(result.probability, 6),
                                      _mapped(e.label, mapping, question.classes),
                                      _mapped(e.router_label, mapping, question.classes), fresh[i]))
        finally:
            reader.close(key)
    return report(question, answers, skipped)


def report(question: Question, answers: list[Answer], skipped: Counter) -> dict[str, Any]:
    routed = [a.router_label for a in answers if a.router_label is not None]
    constant = Counter(routed).most_common(1)[0][0] if routed else None
    fresh = [a for a in answers if a.is_fresh]
    return {
        "classes": list(question.classes),
        "questions": len(answers),
        "skipped": dict(skipped),
        "vs_router": _rate([(a.label, a.router_label) for a in answers]),
        "vs_live": _rate([(a.label, a.live_label) for a in answers]),
        "fresh": {"vs_router": _rate([(a.label, a.router_label) for a in fresh]),
                  "constant_baseline": _rate([(constant, a.router_label) for a in fresh]) if constant else None},
        "constant_baseline": {"class": constant, **_rate([(constant, a.router_label) for a in answers])}
        if constant else None,
        "labels": dict(Counter(a.label for a in answers)),
        "answers": [asdict(a) for a in answers],
    }


__all__ = ["Answer", "JournalEntry", "Question", "RouterEvalError", "evaluate", "parse_mapping", "question_ids",
           "read_journal", "report"]
