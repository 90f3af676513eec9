"""Batched decode rounds: the next token of every running sequence in one forward, replayed from a CUDA graph
captured per batch-size bucket.

    rounds = DecodeRounds(engine, pool, max_running)
    rounds.warm()                                  capture every bucket now (else on first use)
    slot = rounds.admit(cache)                     the sequence's GDN state into a free slot (None: all taken)
    logits = rounds.run([s0, s1, ...], tokens)     one round; row i is slot s_i's next token, fp32 [B, vocab]
    cache = rounds.release(slot)                   the slot's state back into the cache; the slot is free
    logits = rounds.verify(slots, rows)            a verify (speculative decoding): T rows a slot, fp32 [B, T, vocab]
    rounds.keep(slots, accepted)                   each slot keeps the state after row accepted[i]; length += it + 1

With the checkpoint's MTP head (mtp=True) the rounds draft for themselves, on the device:

    rounds.mtp_rows(kv, start, next_ids, hidden)   the head's rows of a prompt's chunk (a sequence not admitted)
    drafts = rounds.mtp_prefill(slot, next_ids, hidden)   the head's rows of a prompt; its k drafts [k]
    logits = rounds.verify(slots, rows)            rows [B, k + 1] on the device: [next token, its drafts]
    rounds.keep(slots, accepted)
    drafts = rounds.draft(slots, next_ids, accepted)   the head extends over the rows just verified, drafts [B, k]
    rows = torch.cat((next_ids[:, None], drafts), 1)   the next verify's rows, never read by the host

Who owns what
- The caller (the conductor) owns the sequences: each one's SequenceCache and the pages of its PagedKV in
  `pool`, sampling, and the choice of which slots run in a round. A round takes a new page for a row that
  crosses a page line (kv.ensure); `can_run` says beforehand whether the pool has the pages.
- While a sequence is admitted this object owns its GDN state and its length: the slot holds the one live
  copy of the state (the cache's own state tensors are stale until `store` or `release`), and `run` advances
  cache.length by one a round. Nothing else may forward that cache, truncate its pages or write its rows.
- This object owns the slot states (SlotStates, one slot a running sequence and one for padding), each slot's
  row of the device page table, the staged inputs, the graphs, and one scratch page of `pool` (padding rows
  write there).

Invariants
- Row i of a round is the token at position cache.length of the sequence in slot slots[i]: its K/V go to that
  row of its pages, it attends over its rows [0, length], its slot's state steps once. Slots in a round are
  distinct and admitted.
- A round of B rows runs the graph of the smallest bucket >= B (1, 2, 4, ... up to max_running). The rows past
  B are padding: slot `pad_slot`, position 0, the scratch page. They touch no sequence's state or rows. Where
  the op set's GEMMs are row-invariant (QSE_KERNELS=invariant) a row's logits are the same bits whatever the
  round holds; elsewhere (cuBLAS, torch's CPU matmul pick their algorithm by the row count) the bucket can
  change the rounding, and greedy tokens agree except on near-ties.
- `run` never waits on the device: its host inputs go up by an asynchronous copy from pinned memory, and the
  tokens may be a device tensor (the previous round's on-device argmax), or rows may `carry` the id the
  caller wrote into `sampled` in the last round, so round n+1 can be launched before round n's tokens are read
  back; `send_back` starts their copy to pinned memory and `ids()` waits for it (read a round's ids before
  two more are sent back). The logits returned are a view of a buffer the next `run` overwrites: read
  them, or queue device work on them (stream order keeps that safe), before then.
- Time a round with the engine's DeviceClock marks around `run` (same stream; no synchronisation added).
- A verify (`verify_width` >= 2) reads T rows of each slot at once: row j of slot s is the token at position
  cache.length + j, its GDN state stepped from row j - 1's into scratch slot `scratch_base + s * W + j`
  (W = verify_width), so the slot's own state is the one before the verify until `keep` copies the accepted
  row's over it. K/V rows above what is kept are written and never read: a row attends below its position,
  and the next round writes them again. Between a verify and its keep the slot runs nothing else.
- graphs=None captures where the device is CUDA and the kernels are qse's; otherwise (and with "static") the
  same buffers, copies and calls run without capturing: the CPU rehearsal of the graph path.

The MTP head (mtp=True; qse/models/qwen3_5/mtp.py)
- Where its KV lives: in the rounds' own pool, one KV slot past the model's attention layers (`mtp_kv_slot`; the
  pool is built with attention layers + 1 slots, `pool_slots_for`). The head's row of position t sits in the
  same page as the target's row t, so one page table (the slot's row of `tables`), one `ensure` and one
  release serve both, and the head's rows leave with the sequence's pages. A pool of its own would need a
  second table, allocator and lifetime a sequence, for nothing: the rows are one a position on both sides.
  (A page costs 1 / attention layers more: 1/8 at the 9B.) The slot is not in the model's manifest: a session
  stored and restored carries the target's rows only (the head's are then stale: drafts worse, never wrong).
- Each round's entry has a final-hidden tap [rows, H] that this object owns (decode_step fills it). `draft`
  follows a round (a verify or a run, its keep before or after) before any other round, and runs the head over
  that round's rows at its fixed shape: row j of a slot pairs its final hidden with the id after it, which is
  the next draft it verified where j < accepted and next_ids where j == accepted (rows above are written and
  overwritten later: the head's row a position, above the kept length); then k drafts from the accepted row's
  output, each an argmax on the device. One graph per (bucket, width, k); no host read, no ragged shape.
- The head's rows of a prompt come from its prefill's final-hidden taps (`mtp_prefill`); a sequence admitted
  without them drafts from stale rows, which makes the drafts worse, never the output wrong (the verify keeps
  only what the target itself picks). The head's slot of the whole pool is zeroed when the rounds are made, so a
  row it never wrote is finite (a CPU pool's slot becomes resident memory then).
- A round of these slots reaches verify_width - 2 rows further than it reads (a k-draft's rows past the kept
  ones): `pages_needed` and the round's page ensure count them.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from ..models.cache import SequenceCache, VerifyWindow
from ..models.inputs import DecodeBatch, InputError
from .engine import Engine
from .graphs import _Entry, capture_mode
from .kv import KVPool, PagedKV

# staged inputs, one row each of a [4, bucket] long buffer (one host-to-device copy a round); CARRY: the row of
# `sampled` a round row reads its id from (-1: the staged host id)
IDS, POSITIONS, SLOTS, CARRY = 0, 1, 2, 3
# pinned staging buffers in turn: the host may stage round n+1 while round n's copy is still queued
STAGING_RING = 2


def slot_states_for(max_running: int, verify_width: int = 0) -> int:
    """The GDN state slots a DecodeRounds holds: one a running sequence and one for padding rows, each with
    verify_width scratch slots beside it (a verify's rows); what the memory sizing counts."""
    return (max_running + 1) * (1 + verify_width)


def mtp_kv_slot(cfg: Any) -> int:
    """The KV slot of the rounds' pool holding the MTP head's rows: the one past the model's attention layers."""
    return len(cfg.attention_layers)


def pool_slots_for(cfg: Any, mtp: bool = False) -> int:
    """KV slots a page of the rounds' pool holds: one an attention layer, and one for the MTP head (mtp)."""
    return len(cfg.attention_layers) + (1 if mtp else 0)


def buckets_for(max_running: int) -> tuple[int, ...]:
    """Powers of two below max_running, then max_running itself: a round pads to at most twice its rows."""
    out, n = [], 1
    while n < max_running:
        out.append(n)
        n *= 2
    return (*out, max_running)


class TokensBack:
    """A round's sampled ids on their way to the host (DecodeRounds.send_back)."""

    def __init__(self, host: torch.Tensor, ready: Any):
        self._host, self._ready = host, ready

    def ids(self) -> list[int]:
        if self._ready is not None:
            self._ready.synchronize()
        return self._host.tolist()


class DecodeRounds:
    def __init__(self, engine: Engine, pool: KVPool, max_running: int, graphs: bool | str | None = None,
                 buckets: Sequence[int] | None = None, verify_width: int = 0, mtp: bool = False):
        """graphs: None = CUDA graphs where the device is CUDA and the kernels are Triton's; True; False or
        "static" (the same flow without capturing). buckets: the batch sizes with a graph of their own (default
        buckets_for(max_running)); the largest must hold max_running rows. verify_width: the most rows a slot
        may verify at once (0: no verify; each slot then has no scratch slots). mtp: draft with the model's MTP
        head (`draft`, `mtp_prefill`; drafts of 1 .. verify_width - 1 ids; the pool needs pool_slots_for(cfg,
        mtp=True) slots)."""
        if max_running < 1:
            raise ValueError(f"max_running must be at least 1; got {max_running}")
        if verify_width == 1 or verify_width < 0:
            raise ValueError(f"verify_width is 0 (no verify) or the most rows a verify reads (>= 2); got {verify_width}")
        self.buckets = tuple(sorted(set(buckets))) if buckets else buckets_for(max_running)
        if self.buckets[0] < 1 or self.buckets[-1] < max_running:
            raise ValueError(f"buckets {self.buckets} must be positive and reach max_running={max_running}")
        self.engine, self.model, self.pool = engine, engine.model, pool
        if verify_width:  # a verify row must round as a plain round's row of the same token (greedy == plain)
            engine.round_rows_alike()
        self.mtp = None  # the MTP head, where the rounds draft with it
        if mtp:
            if verify_width < 2:
                raise ValueError(f"MTP drafts are verified: give verify_width >= 2 (k + 1 for k drafts); got "
                                 f"{verify_width}")
            self.mtp = engine.model.mtp_head()
            self.mtp_slot = mtp_kv_slot(engine.cfg)
            if pool.num_slots <= self.mtp_slot:
                raise ValueError(f"the MTP head's rows live in KV slot {self.mtp_slot} of the pool, which has "
                                 f"{pool.num_slots} slots: build it with pool_slots_for(cfg, mtp=True) = "
                                 f"{pool_slots_for(engine.cfg, True)}")
            # rows the head never wrote (a prompt's chunks, a restored session's) hold zeros, never NaN: its
            # attention over them stays finite (its drafts worse there, never a poisoned sequence)
            pool.k[:, self.mtp_slot].zero_()
            pool.v[:, self.mtp_slot].zero_()
        # a round reaches this many rows past what it reads (read by the callers that reserve its pages): a
        # draft of verify_width - 1 ids writes rows up to verify_width - 2 past the round's last (the head's,
        # above what is kept)
        self.draft_reach = verify_width - 2 if mtp else 0
        self.device = pool.k.device
        self.capture = capture_mode(engine, graphs, "decode rounds") is True
        self.max_running = max_running
        self.pad_slot = max_running  # the last slot: padding rows only
        self.verify_width = verify_width
        # each slot's verify rows (the padding slot's too: padding rows verify like the others)
        self.scratch_base = max_running + 1
        self.states = self.model.new_slot_states(slot_states_for(max_running, verify_width))
        self._verifying: set[int] = set()
        scratch = pool.allocate(1)
        if scratch is None:
            raise MemoryError(f"the KV pool ({pool.num_pages} pages) has no free page for the rounds' padding rows")
        self._scratch = scratch
        # row s: slot s's page ids (entries past its pages are stale and never read: a row attends below its length)
        self.tables = torch.zeros(max_running + 1, pool.num_pages, dtype=torch.int32, device=self.device)
        self.tables[self.pad_slot] = scratch[0]  # every padding row's position, whatever it is, lands there
        self.max_rows = pool.num_pages * pool.page_rows  # what an attention launch is sized for
        self._free = list(range(max_running - 1, -1, -1))  # pop() hands out low slots first
        self._caches: dict[int, SequenceCache] = {}
        self._pages_up: dict[int, int] = {}  # how many of each slot's pages its table row holds
        width = self.buckets[-1] * max(1, verify_width)
        self._inputs = torch.zeros(4, width, dtype=torch.long, device=self.device)
        cuda = self.device.type == "cuda"
        self._host = [torch.zeros(4, width, dtype=torch.long, pin_memory=cuda) for _ in range(STAGING_RING)]
        self._sent: list[Any] = [None] * STAGING_RING  # the event after the last copy out of each host buffer
        self._turn = 0
        # the ids the caller sampled on the device for the last round (row i: that round's row i): the next
        # round may read them (carry) before the host has; the host gets them through a pinned ring (send_back)
        self.sampled = torch.zeros(width, dtype=torch.long, device=self.device)
        self._back = [torch.zeros(width, dtype=torch.long, pin_memory=cuda) for _ in range(STAGING_RING)]
        self._back_ready: list[Any] = [None] * STAGING_RING
        self._back_turn = 0
        self._entries: dict[tuple[int, int], _Entry] = {}
        # a verify row's place in its slot's window (0 .. W - 1): this object owns it, since a captured graph keeps
        # only its address (a tensor made for one capture is freed once the capture's closure is, and the graph
        # would then read whatever the allocator put there)
        self._row_offsets = torch.arange(max(1, verify_width), dtype=torch.long, device=self.device)
        self._graph_pool = torch.cuda.graph_pool_handle() if self.capture else None
        # the MTP head's side: each round entry's final-hidden tap, what `draft` stages (row NEXT: the id after
        # each slot's accepted row, row ACCEPTED: its accepted count) and the last round's (slots, size, width)
        self._hidden: dict[tuple[int, int], torch.Tensor] = {}
        self._draft_in = torch.zeros(2, self.buckets[-1], dtype=torch.long, device=self.device)
        self._last_round: tuple[tuple[int, ...], int, int] | None = None

    # ---- sequences in and out ----------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def running(self) -> list[int]:
        """The admitted slots, in slot order."""
        return sorted(self._caches)

    def admit(self, cache: SequenceCache) -> int | None:
        """A free slot now holding the cache's GDN state (its KV rows stay in its pages of `pool`); None when
        every slot is taken."""
        kv = cache.kv
        if not isinstance(kv, PagedKV) or kv.pool is not self.pool:
            raise ValueError("a sequence joins a round with its KV rows in the rounds' own pool (a PagedKV of it)")
        if any(c is cache for c in self._caches.values()):
            raise ValueError("this cache is already admitted")
        if not self._free:
            return None
        slot = self._free.pop()
        self.states.load(slot, cache)
        self._caches[slot] = cache
        self._pages_up[slot] = 0
        self._upload_pages(slot, kv)
        return slot

    def store(self, slot: int) -> SequenceCache:
        """The slot's state copied into its cache (which stays admitted); returns the cache."""
        cache = self._cache(slot)
        self.states.store(slot, cache)
        return cache

    def release(self, slot: int, keep: bool = True) -> SequenceCache:
        """Free the slot; keep: its state is copied back into the cache first (else the cache's state is stale).
        Returns the cache; its pages stay the caller's."""
        cache = self._cache(slot)
        if keep:
            self.states.store(slot, cache)
        del self._caches[slot], self._pages_up[slot]
        self._verifying.discard(slot)  # a verify never kept: the slot's own state is the one before it
        if self._last_round is not None and slot in self._last_round[0]:
            self._last_round = None
        self._free.append(slot)
        return cache

    def _cache(self, slot: int) -> SequenceCache:
        cache = self._caches.get(slot)
        if cache is None:
            raise ValueError(f"slot {slot} holds no sequence; admitted: {self.running}")
        return cache

    # ---- rounds ------------------------------------------------------------------------------
    def bucket(self, num_rows: int) -> int:
        """The batch size whose graph runs a round of num_rows rows."""
        if not 1 <= num_rows <= self.max_running:
            raise ValueError(f"a round holds 1..{self.max_running} rows; got {num_rows}")
        return next(size for size in self.buckets if size >= num_rows)

    def pages_needed(self, slots: Sequence[int], width: int = 1) -> int:
        """Pages the pool must hand out for a round of these slots (rows crossing a page line), each reading
        `width` rows (a verify's)."""
        need = 0
        for slot in slots:
            kv = self._cache(slot).kv
            need += max(0, kv.pages_for(self._caches[slot].length + width + self.draft_reach) - len(kv.pages))
        return need

    def can_run(self, slots: Sequence[int], width: int = 1) -> bool:
        return self.pages_needed(slots, width) <= self.pool.num_free

    def run(self, slots: Sequence[int], tokens: Sequence[int] | torch.Tensor,
            carry: Sequence[int] | None = None) -> torch.Tensor:
        """One round: row i reads tokens[i] as the next token of the sequence in slots[i]. tokens: host ids, or
        a long tensor [B] on the device (e.g. the previous round's argmax, never read back here). carry: row i
        reads sampled[carry[i]] instead where carry[i] >= 0 (the id the caller sampled on the device in the last
        round; tokens[i] is then ignored). Returns the logits fp32 [B, vocab] (a view of the bucket's output
        buffer, valid until the next run); each row's cache.length has advanced by one."""
        num_rows = len(slots)
        size = self.bucket(num_rows)
        caches = self._round_caches(slots, 1)
        if carry is not None:
            if isinstance(tokens, torch.Tensor) or len(carry) != num_rows:
                raise ValueError(f"carry needs host tokens and one entry a row; got {len(carry)} for {num_rows} rows")
            tokens = [0 if c >= 0 else t for t, c in zip(tokens, carry)]
        self._check_tokens(tokens, num_rows)
        self._ensure_pages(slots, caches, 1)
        entry = self._prepare(size)
        self._stage(slots, [c.length for c in caches], tokens, size, carry)
        out = entry.replay()
        out = entry.out if self.capture else out
        for cache in caches:
            cache.length += 1
        self._last_round = (tuple(slots), size, 1)
        return out[:num_rows]

    def verify(self, slots: Sequence[int], rows: Sequence[Sequence[int]] | torch.Tensor) -> torch.Tensor:
        """A verify: slot slots[i] reads rows[i] (T ids: its next token, then T - 1 drafted ones; a host list a
        slot, or a long tensor [B, T] on the device) at positions cache.length .. + T - 1, in one forward.
        Returns the logits fp32 [B, T, vocab] (row j: the distribution of the id after rows[i][j]; a view valid
        until the next run or verify). Nothing is kept yet: `keep` says how many rows each slot keeps."""
        num_seqs = len(slots)
        width = int(rows.shape[1]) if isinstance(rows, torch.Tensor) and rows.dim() == 2 else (
            len(rows[0]) if num_seqs and not isinstance(rows, torch.Tensor) else 0)
        if not 2 <= width <= self.verify_width:
            raise ValueError(f"a verify reads 2..{self.verify_width} rows a slot (verify_width); got {width}")
        size = self.bucket(num_seqs)
        caches = self._round_caches(slots, width)
        if isinstance(rows, torch.Tensor):
            if rows.shape != (num_seqs, width):
                raise ValueError(f"device rows must be [{num_seqs}, {width}]; got {tuple(rows.shape)}")
            flat: Sequence[int] | torch.Tensor = rows.reshape(-1)
        else:
            if len(rows) != num_seqs or any(len(r) != width for r in rows):
                raise ValueError(f"a verify reads the same number of rows for every slot; got {[len(r) for r in rows]}")
            flat = [t for r in rows for t in r]
        self._check_tokens(flat, num_seqs * width)
        self._ensure_pages(slots, caches, width)
        entry = self._prepare(size, width)
        self._stage([s for s in slots for _ in range(width)],
                    [c.length + j for c in caches for j in range(width)], flat, size * width, None, width)
        out = entry.replay()
        out = entry.out if self.capture else out
        self._verifying.update(slots)
        self._last_round = (tuple(slots), size, width)
        return out[: num_seqs * width].view(num_seqs, width, -1)

    def keep(self, slots: Sequence[int], accepted: Sequence[int]) -> None:
        """After a verify of these slots: slot slots[i] keeps the state after its row accepted[i] (0: its next
        token only, T - 1: every draft) and its cache.length grows by accepted[i] + 1. Device copies only."""
        if len(accepted) != len(slots):
            raise ValueError(f"{len(slots)} slots but {len(accepted)} accepted counts")
        for slot, count in zip(slots, accepted):
            if slot not in self._verifying:
                raise ValueError(f"slot {slot} has no verify to keep")
            if not 0 <= count < self.verify_width:
                raise ValueError(f"slot {slot}: accepted {count} must lie in [0, {self.verify_width})")
        width = self.verify_width
        index = torch.tensor([[s, self.scratch_base + s * width + c] for s, c in zip(slots, accepted)], dtype=torch.long)
        index = self._up(index)
        self.states.keep(index[:, 0], index[:, 1])
        for slot, count in zip(slots, accepted):
            self._verifying.discard(slot)
            self._caches[slot].length += count + 1

    # ---- the MTP head's drafts ---------------------------------------------------------------
    def mtp_prefill(self, slot: int, next_ids: Sequence[int] | torch.Tensor, hidden: torch.Tensor,
                    k: int | None = None) -> torch.Tensor:
        """The head's rows of the slot's last T rows (positions cache.length - T .. cache.length - 1): row i pairs
        hidden[i] [T, H], the target's final hidden there (its forward's "final_hidden" tap), with next_ids[i],
        the id after it (a prompt's ids from its second on, then the first id sampled). Returns the k drafts
        after the last row (long [k] on the device; k default verify_width - 1): the first verify's drafts.
        Eager, once a turn; the draft's rows may take a page from the pool (a MemoryError where none is free)."""
        head = self._require_mtp()
        cache = self._cache(slot)
        if slot in self._verifying:
            raise ValueError(f"slot {slot} was verified and not kept: keep() its accepted rows first")
        k = self._draft_k(k)
        ids = next_ids if isinstance(next_ids, torch.Tensor) else torch.tensor(list(next_ids), dtype=torch.long)
        num_rows = int(ids.shape[0]) if ids.dim() == 1 else 0
        if not 1 <= num_rows <= cache.length:
            raise ValueError(f"slot {slot} holds {cache.length} rows: the head's prefill pairs 1..{cache.length} of "
                             f"them with their next ids; got ids of shape {tuple(ids.shape)}")
        self._check_tokens(ids.tolist() if ids.device.type == "cpu" else ids, num_rows)
        rows = self._head_rows(cache.kv, cache.length - num_rows, ids, hidden)
        drafts = head.draft(rows, k)
        self._upload_pages(slot, cache.kv)  # the drafts' rows may have taken a page
        return drafts

    def mtp_rows(self, kv: PagedKV, start: int, next_ids: Sequence[int], hidden: torch.Tensor) -> None:
        """The head's rows at positions start .. start + T - 1 of a sequence that is not admitted (a prompt's
        grid chunk as it is read; its caller owns the pages, which must hold the rows): row i pairs hidden[i]
        [T, H] with next_ids[i], the id after it. Eager, never waits on the device."""
        self._require_mtp()
        if kv.pool is not self.pool or any(c.kv is kv for c in self._caches.values()):
            raise ValueError("the head's rows of a sequence that is not admitted, in the rounds' own pool")
        num_rows = len(next_ids)
        if num_rows != hidden.shape[0] or not 0 <= start or start + num_rows > kv.capacity:
            raise ValueError(f"{num_rows} ids and {hidden.shape[0]} hiddens at rows {start}.. of a sequence with "
                             f"pages for {kv.capacity} rows")
        self._check_tokens(list(next_ids), num_rows)
        self._head_rows(kv, start, torch.tensor(list(next_ids), dtype=torch.long), hidden)

    def _head_rows(self, kv: PagedKV, start: int, ids: torch.Tensor, hidden: torch.Tensor):
        rows = self.mtp.new_cache(kv, slot=self.mtp_slot)
        rows.length = start
        self.mtp.forward(ids.to(self.device), hidden, rows)
        return rows

    def draft(self, slots: Sequence[int], next_ids: Sequence[int] | torch.Tensor,
              accepted: Sequence[int] | torch.Tensor | None = None, k: int | None = None) -> torch.Tensor:
        """After the round of these slots (a verify, or a run: the last round, with the slots in its order; keep
        may come before or after): the head reads that round's rows and drafts k ids a slot (k default
        verify_width - 1; k = 0: the head's rows alone, no draft: its KV rows stay current for a later draft,
        and the output head, most of a draft's cost, is not read). next_ids[i]: the id after slot slots[i]'s
        accepted row (the verify's next pick, the run's sampled id); accepted[i]: its accepted count (None: 0, as
        after a run). Either may be a long tensor [B] on the device, never read here. Returns the drafts, long
        [B, k] on the device (a view of a buffer the next draft overwrites): the next verify reads
        [next_ids, drafts]."""
        self._require_mtp()
        last = self._last_round
        if last is None or last[0] != tuple(slots):
            raise ValueError(f"a draft follows the round of its slots, in their order: the last round ran "
                             f"{list(last[0]) if last else None}; got {list(slots)}")
        _, size, width = last
        k = self._draft_k(k, rows_only=True)
        num_seqs = len(slots)
        host = torch.zeros(2, size, dtype=torch.long)
        self._check_tokens(next_ids, num_seqs)
        if not isinstance(next_ids, torch.Tensor):
            host[0, :num_seqs] = torch.tensor(list(next_ids), dtype=torch.long)
        if isinstance(accepted, torch.Tensor):
            if accepted.shape != (num_seqs,) or accepted.dtype != torch.long or accepted.device != self.device:
                raise ValueError(f"device accepted counts must be a long tensor [{num_seqs}] on {self.device}; got "
                                 f"{accepted.dtype} {tuple(accepted.shape)} on {accepted.device}")
        elif accepted is not None:
            if len(accepted) != num_seqs or any(not 0 <= a < width for a in accepted):
                raise ValueError(f"accepted counts: one a slot in [0, {width}) (the round read {width} rows a slot); "
                                 f"got {list(accepted)}")
            host[1, :num_seqs] = torch.tensor(list(accepted), dtype=torch.long)
        self._draft_in[:, :size].copy_(self._up(host))
        if isinstance(next_ids, torch.Tensor):
            self._draft_in[0, :num_seqs].copy_(next_ids)
        if isinstance(accepted, torch.Tensor):
            self._draft_in[1, :num_seqs].copy_(accepted)
        entry = self._prepare_draft(size, width, k)
        out = entry.replay()
        out = entry.out if self.capture else out
        return out[:num_seqs]

    def _require_mtp(self):
        if self.mtp is None:
            raise ValueError("these rounds hold no MTP head: build them with mtp=True to draft")
        return self.mtp

    def _draft_k(self, k: int | None, rows_only: bool = False) -> int:
        """k, checked: 1..verify_width - 1 ids (None: the most); 0 too where rows_only (the head's rows alone)."""
        k = self.verify_width - 1 if k is None else k
        if not (0 if rows_only else 1) <= k < self.verify_width:
            raise ValueError(f"a draft holds {0 if rows_only else 1}..{self.verify_width - 1} ids (verify_width - 1);"
                             f" got k={k}")
        return k

    def _round_caches(self, slots: Sequence[int], width: int) -> list[SequenceCache]:
        """The slots' caches, checked for a round that reads `width` rows a slot."""
        if len(set(slots)) != len(slots):
            raise ValueError(f"a slot runs at most once a round; got {list(slots)}")
        caches = [self._cache(slot) for slot in slots]
        window = self.model.cfg.max_position_embeddings
        for slot, cache in zip(slots, caches):
            if slot in self._verifying:
                raise ValueError(f"slot {slot} was verified and not kept: keep() its accepted rows first")
            if cache.length + width > window:
                raise InputError(f"slot {slot}: position {cache.length + width} exceeds the model window {window}")
        return caches

    def _ensure_pages(self, slots: Sequence[int], caches: list[SequenceCache], width: int) -> None:
        need = self.pages_needed(slots, width)
        if need > self.pool.num_free:
            raise MemoryError(f"the KV pool has {self.pool.num_free} free pages; this round needs {need}")
        for slot, cache in zip(slots, caches):
            cache.kv.ensure(cache.length + width + self.draft_reach)
            self._upload_pages(slot, cache.kv)

    @property
    def num_graphs(self) -> int:
        """Graphs captured so far: rounds, verifies and drafts (0 in the static flow)."""
        return len(self._entries) if self.capture else 0

    def warm(self) -> None:
        """Capture every bucket's graph now rather than in the rounds that first need them (with the MTP head,
        the drafts of verify_width - 1 ids after a round of each width, and of one id or none after a plain
        round, too; other draft lengths on first use)."""
        for size in self.buckets:
            self._prepare(size)
            for width in range(2, self.verify_width + 1):  # a round may verify fewer rows (the planner's pick)
                self._prepare(size, width)
            if self.mtp is not None:
                for width in (1, *range(2, self.verify_width + 1)):
                    self._prepare_draft(size, width, self.verify_width - 1)
                self._prepare_draft(size, 1, 1)  # a plain round's one-id draft: a turn of it looks next round
                self._prepare_draft(size, 1, 0)  # the head's rows alone: no turn of it looks next round

    def release_all(self) -> None:
        """Drop the graphs and give the scratch page back (admitted caches are the caller's to release)."""
        self._entries.clear()
        self._hidden.clear()
        if self._scratch:
            self.pool.release(self._scratch)
            self._scratch = []

    def _check_tokens(self, tokens: Sequence[int] | torch.Tensor, num_rows: int) -> None:
        if isinstance(tokens, torch.Tensor):
            if tokens.shape != (num_rows,) or tokens.dtype != torch.long or tokens.device != self.device:
                raise ValueError(f"device tokens must be a long tensor [{num_rows}] on {self.device}; got "
                                 f"{tokens.dtype} {tuple(tokens.shape)} on {tokens.device}")
            return
        if len(tokens) != num_rows:
            raise ValueError(f"{num_rows} slots but {len(tokens)} tokens")
        vocab = self.model.cfg.vocab_size
        for token in tokens:
            if not 0 <= token < vocab:
                raise InputError(f"token id {token} is outside the vocabulary [0, {vocab})")

    def _up(self, host: torch.Tensor) -> torch.Tensor:
        """A small host tensor on the device without waiting for the stream: pinned, then copied asynchronously
        (a pageable copy waits; the caching host allocator keeps the pinned block until the copy has run)."""
        if self.device.type != "cuda":
            return host.to(self.device)
        return host.pin_memory().to(self.device, non_blocking=True)

    def _upload_pages(self, slot: int, kv: PagedKV) -> None:
        """New pages of the slot's sequence into its table row (pages only grow while it is admitted)."""
        have, now = self._pages_up[slot], len(kv.pages)
        if now < have:
            raise RuntimeError(f"slot {slot}'s pages went from {have} to {now} while it was admitted")
        if now > have:
            self.tables[slot, have:now].copy_(self._up(torch.tensor(kv.pages[have:], dtype=torch.int32)))
            self._pages_up[slot] = now

    def _stage(self, slots: Sequence[int], positions: list[int], tokens: Sequence[int] | torch.Tensor,
               size: int, carry: Sequence[int] | None = None, width: int = 1) -> None:
        """The round's ids, positions and slots (padding rows past B) into the buffers the graph reads (a
        verify's rows: `width` rows a slot, padding slots' rows at positions 0 .. width - 1)."""
        num_rows, pad = len(slots), size - len(slots)
        host_ids = [0] * num_rows if isinstance(tokens, torch.Tensor) else list(tokens)
        carried = list(carry) if carry is not None else [-1] * num_rows
        pad_positions = [j for _ in range(pad // width) for j in range(width)]
        rows = torch.tensor([host_ids + [0] * pad, positions + pad_positions, list(slots) + [self.pad_slot] * pad,
                             carried + [-1] * pad], dtype=torch.long)
        if self.device.type == "cuda":
            turn = self._turn
            self._turn = (turn + 1) % STAGING_RING
            host = self._host[turn]
            if self._sent[turn] is not None:
                self._sent[turn].synchronize()  # its last copy has left (two rounds ago)
            else:
                self._sent[turn] = torch.cuda.Event()
            host[:, :size].copy_(rows)
            self._inputs[:, :size].copy_(host[:, :size], non_blocking=True)
            self._sent[turn].record()
        else:
            self._inputs[:, :size].copy_(rows)
        if isinstance(tokens, torch.Tensor):
            self._inputs[IDS, :num_rows].copy_(tokens)
        elif carry is not None and any(c >= 0 for c in carry):  # on the device, after the upload: no wait
            src = self._inputs[CARRY, :num_rows]
            ids = self._inputs[IDS, :num_rows]
            ids.copy_(torch.where(src >= 0, self.sampled.index_select(0, src.clamp(min=0)), ids))

    def send_back(self, num_rows: int) -> "TokensBack":
        """Start copying sampled[:num_rows] to the host (pinned, asynchronous on cuda); the answer's ids()
        waits for it. A ring of STAGING_RING buffers: read a round's ids before sending back two more."""
        turn = self._back_turn
        self._back_turn = (turn + 1) % STAGING_RING
        host = self._back[turn][:num_rows]
        if self.device.type == "cuda":
            if self._back_ready[turn] is None:
                self._back_ready[turn] = torch.cuda.Event()
            host.copy_(self.sampled[:num_rows], non_blocking=True)
            self._back_ready[turn].record()
            return TokensBack(host, self._back_ready[turn])
        host.copy_(self.sampled[:num_rows])
        return TokensBack(host, None)

    def _prepare(self, size: int, width: int = 1) -> _Entry:
        """The entry of a round of `size` slots, `width` rows each (1: a decode round; >= 2: a verify)."""
        entry = self._entries.get((size, width))
        if entry is None:
            inputs = self._inputs[:, : size * width]
            offsets = self._row_offsets[:width]
            taps = None
            if self.mtp is not None:  # the rows' final hiddens, for the head's draft after the round
                taps = self.model.new_taps(size * width, ("final_hidden",))
                self._hidden[(size, width)] = taps["final_hidden"]

            def forward() -> torch.Tensor:
                slots = inputs[SLOTS]
                batch = DecodeBatch(inputs[POSITIONS].to(torch.int32), slots, self.tables.index_select(0, slots),
                                    self.pool, self.max_rows)
                window = None
                if width > 1:
                    own = slots[::width]
                    scratch = self.scratch_base + own[:, None] * self.verify_width + offsets[None, :]
                    window = VerifyWindow(own, scratch)
                return self.model.decode_step(inputs[IDS], self.states, batch, window, taps=taps)

            entry = self._capture(forward, size * width, width) if self.capture else _Entry(forward)
            entry.holds = inputs
            self._entries[(size, width)] = entry
        return entry

    def _prepare_draft(self, size: int, width: int, k: int) -> _Entry:
        """The entry of the head's draft after a round of `size` slots, `width` rows each: the head over the
        round's rows (its staged ids, positions and slots, its entry's final hiddens), then k drafts a slot from
        its accepted row. What it reads lives in buffers this object owns."""
        key = (size, width, k)
        entry = self._entries.get(key)
        if entry is None:
            self._prepare(size, width)  # the round's entry, and its tap (there already after that round)
            head, kv_slot, rows = self.mtp, self.mtp_slot, size * width
            inputs, step, offsets = self._inputs[:, :rows], self._draft_in[:, :size], self._row_offsets[:width]
            hidden = self._hidden[(size, width)]

            def forward() -> torch.Tensor:
                ids = inputs[IDS].view(size, width)
                positions = inputs[POSITIONS].view(size, width)
                slots = inputs[SLOTS]
                nxt, acc = step[0], step[1]  # [size] each
                # the id after row j: the draft it verified next where that was accepted (j < acc), the slot's
                # next id at j == acc; rows above are the head's rows past the kept length (written over later)
                shifted = torch.cat((ids[:, 1:], nxt[:, None]), dim=1)
                next_ids = torch.where(offsets[None, :] < acc[:, None], shifted, nxt[:, None])  # [size, width]
                batch = DecodeBatch(positions.reshape(-1).to(torch.int32), slots, self.tables.index_select(0, slots),
                                    self.pool, self.max_rows)
                g = head.forward_rows(next_ids.reshape(-1), hidden, batch, kv_slot)  # [rows, H]
                if k == 0:  # the rows alone
                    return torch.zeros(size, 0, dtype=torch.long, device=g.device)
                start = g.view(size, width, -1).gather(1, acc[:, None, None].expand(size, 1, g.shape[1])).squeeze(1)
                own = slots[::width]
                first = DecodeBatch((positions[:, 0] + acc).to(torch.int32), own, self.tables.index_select(0, own),
                                    self.pool, self.max_rows)
                return head.draft_rows(start, first, kv_slot, k)  # [size, k]

            entry = self._capture_draft(forward, size, width) if self.capture else _Entry(forward)
            entry.holds = (inputs, step, hidden)
            self._entries[key] = entry
        return entry

    def _capture_draft(self, forward: Callable[[], torch.Tensor], size: int, width: int) -> _Entry:
        """A draft's graph, captured on padding rows as a round's is; the round's staged rows it is about to read
        are put back after."""
        rows = size * width
        saved = self._inputs[:, :rows].clone(), self._draft_in[:, :size].clone()
        self._draft_in[:, :size].zero_()
        entry = self._capture(forward, rows, width)
        self._inputs[:, :rows].copy_(saved[0])
        self._draft_in[:, :size].copy_(saved[1])
        return entry

    def _capture(self, forward: Callable[[], torch.Tensor], rows: int, width: int = 1) -> _Entry:
        """forward captured as a graph; its warm-up and capture run padding rows only (the scratch page and
        the padding slot), so sequences running meanwhile are not touched."""
        self._inputs[:, :rows].copy_(torch.tensor([[0], [0], [self.pad_slot], [-1]]).expand(4, rows))
        self._inputs[POSITIONS, :rows].copy_(torch.arange(rows) % width)
        stream = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(stream)
        with torch.cuda.stream(side), torch.inference_mode():
            for _ in range(2):  # compiles the kernels, sizes cuBLAS's workspace
                forward()
        stream.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.graph(graph, pool=self._graph_pool, capture_error_mode="thread_local"):
            out = forward()
        return _Entry(graph.replay, out)


__all__ = ["DecodeRounds", "TokensBack", "buckets_for", "mtp_kv_slot", "pool_slots_for", "slot_states_for"]
