"""The shadow reader: grid sessions of a small model, and questions about them on forks.

The sessions' state on the grid (feeding, reading chunk by chunk, checkpoints, rollback, residency)
is the engine-neutral machinery of qse/sessions/grid.py; this module adds what only the reader does:
questions (`ask`) and summaries (`summarize`), each on a fork: the pending tail and the question are
read above the committed rows, and the state is put back afterwards.

A question about a session that is behind by whole chunks (`behind`):
- "read" (the default): those chunks are read on the grid first and kept, as the idle reader would have
  read them (the session's state advances; the asker pays for them), and the fork holds only the tail
  under one chunk and the question. A fork never holds a backlog: its memory and its cost are bounded by
  one chunk plus the question, and nothing read for a question is thrown away.
- "answer_now": nothing is read; the question is asked over the committed rows alone, and the answer
  says how many of the session's ids it did not see (`behind`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ..engine.engine import DeviceClock, Stopwatch
from ..engine.graphs import ForkDecode
from ..sessions.grid import (ChunkReport, DropLRU, FeedReport, GridSessions, Residency, SessionError,
                             SessionTooLong, UnknownSession)
from ..sessions.session import GridSession

# the reader's errors are the session book's (the server maps both to 4xx answers)
ShadowError = SessionError
ShadowSession = GridSession


# forks are read padded to a multiple of this many rows, eager or graphed alike, so that an answer never
# depends on the mode (and the graphs need one shape per 64 rows, not one per length)
FORK_ALIGN = 64
PAD_ID = 0

READ_FIRST, ANSWER_NOW = "read", "answer_now"
BEHIND_MODES = (READ_FIRST, ANSWER_NOW)  # what a question does about whole chunks the reader has not read

@dataclass
class AskResult:
    session_id: str
    distribution: dict[str, float]
    label: str
    probability: float
    position: int  # absolute position of the question's last token + 1 (what it answered over)
    committed: int
    tokens_forwarded: int
    gpu_ms: float  # the fork's and the chunks read for it (read_ms)
    latency_ms: float
    read_tokens: int = 0  # ids read on the grid for this question (kept for the session)
    read_ms: float = 0.0  # their device time
    behind: int = 0  # the session's ids the answer did not see (answer_now on a session behind)
    logits: torch.Tensor | None = field(default=None, repr=False)  # fp32 [vocab]: the answer row's logits


@dataclass
class SummaryResult:
    session_id: str
    token_ids: list[int]
    text: str
    position: int
    gpu_ms: float  # the summary's and the chunks read for it (read_ms)
    ms_per_token: float
    read_tokens: int = 0
    read_ms: float = 0.0
    behind: int = 0


class ShadowReader(GridSessions):
    """The shadow reader: a GridSessions over the reader's engine, with questions on forks."""

    def __init__(self, engine, *args, graphs: bool | str | None = None, **kwargs):
        super().__init__(engine, *args, graphs=graphs, who="the reader", **kwargs)

    # ---- forks -------------------------------------------------------------------------------
    def catch_up(self, session_id: str, limit: int | None = None) -> list[ChunkReport]:
        """Read the session's whole chunks below `limit` (None: every whole chunk known) on the grid and keep
        them: what a question does before its fork (the idle reader would have read the same chunks, to the
        same bits)."""
        return self.read_all(session_id, limit=limit)

    def _before_fork(self, session: ShadowSession, upto: int | None, behind: str) -> tuple[list[ChunkReport], int]:
        """A question's whole chunks behind, per `behind`: read (and kept) or left; returns the reports and
        the end of the ids the fork holds."""
        if behind not in BEHIND_MODES:
            raise ShadowError(f"behind={behind!r}: expected one of {', '.join(BEHIND_MODES)}")
        end = len(session.ids) if upto is None else upto
        if end > self.max_rows and behind != ANSWER_NOW:  # (answer_now forks from the committed rows)
            raise self.too_long(session, end, f"an answer at position {end}")
        self.ensure_resident(session)  # (a dropped session's committed rows are 0 from here)
        if end < session.committed:
            raise ShadowError(f"cannot answer at position {end}: the reader already committed {session.committed} rows")
        if end - session.committed < self.grid:  # under one chunk: the fork holds it
            return [], end
        if behind == ANSWER_NOW:
            return [], session.committed
        reports = self.catch_up(session.session_id, end)
        return reports, end

    def _fork_logits(self, session: ShadowSession, extra: list[int], upto: int | None):
        """The logits after ids[committed:upto] + extra, read above the committed rows; the state is put
        back. The fork is padded to a multiple of FORK_ALIGN rows (the padding sits after the last real
        row, so causality keeps it out of the answer). Returns (logits [vocab] fp32, device ms, the
        absolute position answered at, ids forwarded)."""
        self.ensure_resident(session)
        cache = session.cache
        assert cache is not None
        upto = len(session.ids) if upto is None else upto
        if upto < session.committed:
            raise ShadowError(f"cannot answer at position {upto}: the reader already committed {session.committed} rows")
        ids = session.ids[session.committed : upto] + list(extra)
        total = session.committed + len(ids)
        window = self.engine.cfg.max_position_embeddings
        if total > window:
            raise ShadowError(f"the fork would reach position {total}, past the model window {window}")
        padded = min(-(-len(ids) // FORK_ALIGN) * FORK_ALIGN, window - session.committed)
        ids_padded = ids + [PAD_ID] * (padded - len(ids))
        self.reserve_rows(session, session.committed + padded, len(ids))
        graphs = self.graphs
        try:
            if graphs is not None and graphs.supports(padded):
                logits, gpu_ms = graphs.answer(cache, ids_padded, session.committed, len(ids) - 1)
            else:
                saved = cache.clone_state()
                try:
                    out, gpu_ms = self.engine.forward(cache, self.engine.host_ids(ids_padded), logits="row",
                                                      logit_row=len(ids) - 1)
                finally:
                    cache.set_state(*saved)
                logits = out[0]
        finally:
            self.end_fork(session)
        session.stats.forks += 1
        return logits, gpu_ms, total, len(ids)

    def letter_ids(self, choices: list[str]) -> list[int]:
        if not isinstance(choices, list) or not choices:
            raise ShadowError("choices must be a non-empty list of letters")
        if len(set(choices)) != len(choices):
            dup = next(c for c in choices if choices.count(c) > 1)
            raise ShadowError(f"duplicate choice {dup!r}")
        ids = []
        tok = self.engine.chat.tokenizer
        for c in choices:
            if not isinstance(c, str) or not c:
                raise ShadowError(f"choice {c!r} must be a non-empty string")
            tid = tok.single_token_id(c)
            if tid is None:
                raise ShadowError(f"choice {c!r} is not a single token")
            ids.append(tid)
        return ids

    def ask(self, session_id: str, question_ids: list[int], choices: list[str], upto: int | None = None,
            behind: str = READ_FIRST) -> AskResult:
        """The letters' softmax from one forward of the question over the session up to `upto` (None: all of
        it); whole chunks behind are read first and kept, or left unseen with behind="answer_now"."""
        session = self.get(session_id)
        letters = self.letter_ids(choices)
        if not question_ids:
            raise ShadowError("the question is empty")
        window = self.engine.cfg.max_position_embeddings
        if len(question_ids) > window:
            raise ShadowError(f"the question has {len(question_ids)} tokens, longer than the model window {window}")
        t0 = time.perf_counter()
        reports, end = self._before_fork(session, upto, behind)
        read_ms = sum(r.gpu_ms for r in reports)
        logits, gpu_ms, total, forwarded = self._fork_logits(session, question_ids, end)
        probs = torch.softmax(logits[letters], dim=-1).tolist()
        latency_ms = (time.perf_counter() - t0) * 1e3
        best = max(range(len(choices)), key=lambda i: probs[i])
        result = AskResult(session_id, dict(zip(choices, probs)), choices[best], probs[best], total,
                           session.committed, forwarded, gpu_ms + read_ms, latency_ms,
                           sum(r.chunks for r in reports) * self.grid, read_ms, len(session.ids) - end, logits)
        self.stats.asks += 1
        self.stats.last_answers = (self.stats.last_answers + [{
            "session": session_id, "label": result.label, "probability": round(result.probability, 6),
            "position": total}])[-16:]
        return result

    def summarize(self, session_id: str, prompt_ids: list[int], max_tokens: int, stop_ids: tuple[int, ...] = (),
                  behind: str = READ_FIRST) -> SummaryResult:
        """Greedy decode on a fork: a short summary over the whole session (decode steps replay one graph
        where graphs are on); whole chunks behind as in `ask`."""
        session = self.get(session_id)
        if max_tokens < 1:
            raise ShadowError(f"max_tokens must be >= 1, got {max_tokens}")
        reports, seen = self._before_fork(session, None, behind)
        read_ms = sum(r.gpu_ms for r in reports)
        self.ensure_resident(session)
        cache = session.cache
        assert cache is not None
        ids = session.ids[session.committed : seen] + list(prompt_ids)
        end = session.committed + len(ids)
        window = self.engine.cfg.max_position_embeddings
        if end + max_tokens > window:
            raise ShadowError(f"the summary would reach position {end + max_tokens}, past the model window {window}")
        vocab = self.engine.chat.tokenizer.vocab_size
        graphs = self.graphs
        out_ids: list[int] = []
        watch = Stopwatch(self.engine.device)
        decode_ms = 0.0
        self.reserve_rows(session, end + max_tokens, len(ids))
        saved = None
        try:
            if graphs is not None:
                with graphs.decoding(cache) as fork:
                    with watch.measure():
                        logits = fork.prefill(ids, session.committed)
                        token = int(torch.argmax(logits[-1, :vocab]))
                    prefill_ms = watch.gpu_ms
                    out_ids, decode_ms, steps = self._greedy_on_graph(fork, token, end, vocab, stop_ids, max_tokens)
            else:
                saved = cache.clone_state()
                with watch.measure():
                    logits, _ = self.engine.forward(cache, self.engine.host_ids(ids), "last")
                    token = int(torch.argmax(logits[-1, :vocab]))
                prefill_ms = watch.gpu_ms
                steps = 0
                while token not in stop_ids:
                    out_ids.append(token)
                    if len(out_ids) == max_tokens:
                        break
                    with watch.measure():
                        logits, _ = self.engine.forward(cache, self.engine.host_ids([token]), "last")
                        token = int(torch.argmax(logits[-1, :vocab]))
                    decode_ms += watch.gpu_ms
                    steps += 1
        finally:
            if saved is not None:
                cache.set_state(*saved)
            self.end_fork(session)
        self.stats.summaries += 1
        return SummaryResult(session_id, out_ids, self.engine.chat.tokenizer.decode(out_ids),
                             end, prefill_ms + decode_ms + read_ms, decode_ms / max(1, steps),
                             sum(r.chunks for r in reports) * self.grid, read_ms, len(session.ids) - seen)

    def _greedy_on_graph(self, fork: ForkDecode, first: int, pos: int, vocab: int, stop_ids: tuple[int, ...],
                         max_tokens: int) -> tuple[list[int], float, int]:
        """Greedy decode steps replayed on the one-row graph, pipelined: a step is launched on the device's
        argmax of the step before, ahead of the host reading that token back, so the host's launch overlaps
        the device's work instead of the device waiting for it. The tokens equal those of one step at a
        time; the one step launched on a stop token before the host saw it only wrote the fork's own rows
        and working state, which the fork drops. Returns (tokens, device ms of the steps launched, steps)."""
        if first in stop_ids:
            return [], 0.0, 0
        clock = DeviceClock(self.engine.device)
        out_ids = [first]
        pending = torch.tensor([first], dtype=torch.long, device=self.engine.device)  # the next step's input
        unread = None  # (readback, mark) of a token the device produced and the host has not read
        start = last = clock.mark()
        steps = 0
        while True:
            step = None
            if len(out_ids) + (unread is not None) < max_tokens:  # the pending token's step will be wanted
                logits = fork(pending, pos)
                pending = torch.argmax(logits[-1:, :vocab], dim=-1)
                readback = pending.to("cpu", non_blocking=True)
                last = clock.mark()
                step = (readback, last)
                steps += 1
                pos += 1
            if unread is not None:
                clock.wait(unread[1])
                token = int(unread[0][0])
                if token in stop_ids:
                    break
                out_ids.append(token)
            unread = step
            if unread is None:
                break
        return out_ids, clock.ms(start, last) if steps else 0.0, steps


__all__ = ["ANSWER_NOW", "AskResult", "BEHIND_MODES", "ChunkReport", "DropLRU", "FeedReport", "READ_FIRST", "Residency",
           "SessionTooLong", "ShadowError", "ShadowReader", "SummaryResult", "UnknownSession"]
