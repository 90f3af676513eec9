"""A served turn's drafts: its predicted output first (OpenAI's `prediction`), then prompt lookup.

A client that rewrites a file sends the file as the prediction: the output is expected to be it with a few edits.
Its drafts follow the output's place in the prediction: at the start, the prediction's first ids; later, the ids
after the latest n output ids where they occur in the prediction, nearest after the last place found (an edit
moves the place; n from max_n down to 1). Where the prediction proposes nothing (an edit's new text, or no
prediction), the turn's own prompt and output are looked up (qse/engine/drafters.py: PromptLookup).

Drafts only decide how many ids one forward yields: what the turn emits is the served model's (a greedy turn's
ids are plain decoding's, a sampled turn's follow its law), so a wrong prediction costs rows, never output.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np

from .drafters import PromptLookup, ngram_matches


class PredictedOutput:
    """Proposals from the ids a client predicts the output to be."""

    def __init__(self, ids: Sequence[int], k: int, max_n: int = 4):
        if not (isinstance(k, int) and k >= 1):
            raise ValueError(f"k (ids a proposal holds at most) must be an integer >= 1, got {k!r}")
        self.k, self.max_n = k, max_n
        self._ids = np.asarray(list(ids), dtype=np.int64)
        self._place = 0  # where in the prediction the output is thought to be (the id after the last match)

    def __len__(self) -> int:
        return len(self._ids)

    def propose(self, output: Sequence[int]) -> list[int]:
        """Up to k ids the prediction holds after the output's latest ids ([] where it holds none)."""
        pred = self._ids
        if not len(pred):
            return []
        if not output:
            return pred[: self.k].tolist()
        tail = np.asarray(output[-self.max_n:], dtype=np.int64)
        ends = np.flatnonzero(pred == tail[-1])
        for _, hits in ngram_matches(pred, tail, ends, len(tail), 1):
            hits = hits[hits + 1 < len(pred)]  # an occurrence at the very end has nothing after it
            if len(hits):
                ahead = hits[hits >= self._place - 1]
                end = int(ahead[0] if len(ahead) else hits[-1])
                self._place = end + 1
                return pred[end + 1 : end + 1 + self.k].tolist()
        return []


class TurnDrafts:
    """One running turn's drafter: context_ids is what the turn's first token follows (its prompt);
    `append` the ids it emits; `propose` up to k ids after them."""

    def __init__(self, context_ids: Iterable[int], k: int, prediction_ids: Sequence[int] = (), max_n: int = 3):
        self.k = k
        self.lookup = PromptLookup(context_ids, k=k, max_n=max_n)
        self.prediction = PredictedOutput(prediction_ids, k) if len(prediction_ids) else None
        self.output: list[int] = []

    def append(self, ids: Sequence[int]) -> None:
        self.lookup.append(ids)
        self.output.extend(ids)

    def propose(self) -> list[int]:
        """Drafts after the ids the turn has emitted (the last of them is the next round's input)."""
        if self.prediction is not None:
            # the prediction is of the output: its place is found from the output's ids alone
            drafts = self.prediction.propose(self.output)
            if drafts:
                return drafts
        return self.lookup.propose()


__all__ = ["PredictedOutput", "TurnDrafts"]
