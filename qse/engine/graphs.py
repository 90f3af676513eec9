"""The forward as CUDA graphs over one KV pool: one graph per (rows, logits) shape, replayed for every
session at every position.

A graph holds addresses, so everything a forward touches lives in buffers this object owns and
never moves: the ids, the position (`start`, read on the device by the rotary and the attention
kernel), the page table, and one working copy of the GDN state. A session's state is copied into the
working state before a replay and back after it (about 40 MB for the 0.8B, some 15 µs); its KV rows
are written straight into the session's own pool pages through the page table, and the pool never
moves. So a graph captured once stays valid as sessions grow, move and come and go.

Forks need no put-back of the GDN state: a fork replays on the working copy and simply does not copy
it back.

`capture=False` runs the very same flow (the same buffers, copies and calls) without capturing: each
replay calls the forward again. It is the CPU rehearsal of the graph path, which the tests use; the
bits equal an eager forward whenever the kernels do not depend on the launch (ours do not: see
qse_kernels.attention on split counts).

A chunk group reads several grid chunks of one session in one replay, skewed over
streams: the layers split into GROUP_STAGES ranges, range s of every chunk on stream s, so the first
half of the layers of chunk i+1 runs beside the second half of chunk i (two ranges). The ranges touch
different layers' state and KV rows, and chunk i+1's range s needs only chunk i's range s (the same
stream), so the only edge between streams is a chunk's hand-over from one range to the next. Every
layer still runs the same kernels on the same values: the bits of reading the chunks one at a time (the
group only lets the device fill the SMs one range's latency-bound kernels leave idle).

The callers' verbs (the order of capture, staging, state copies and replay stays in here):

    graphs.warm(rows, group)                        capture the chunk graphs now (else on first use)
    graphs.can_group(n, rows)                       a group of n chunks can run (captured); False: read one
    begin = graphs.run_chunks(cache, ids, start, n) read n chunks into cache; a device mark before them
    logits, gpu_ms = graphs.answer(cache, ids, pos, row)  a question's forward on a working copy
    logits, hidden = graphs.run_tail(cache, ids, start)  a prompt's tail, padded to its class (TAIL_CLASS rows)
    with graphs.decoding(cache) as fork:            greedy decode on a fork, never stored back
        logits = fork.prefill(ids, pos)             eager (any length)
        logits = fork(token, pos)                   the one-row graph, launched without waiting

Order that matters under CUDA (a CPU test cannot see it): a capture runs the forward on the working state
and the scratch pages, so every entry is captured before the working state is loaded; a chunk's ids are
staged before its state is loaded, so the host's share of the launch goes out before the device's;
`run_chunks` and a fork's steps never wait on the device.
"""

from __future__ import annotations

from dataclasses import dataclass
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch

from ..models.cache import SequenceCache
from ..models.inputs import Step
from .engine import DeviceClock, Stopwatch
from .kv import KVPool, PagedKV

# a chunk group's layers run in this many ranges on as many streams. A 0.8B 64k read (chunk_groups-sweep*,
# H200) in groups of 16: 8.29 ms per 1000 tokens at 2 ranges, 8.01-8.05 at 4 and at 6, 8.18 at 8, 8.27 at 12
# (one chunk a launch: 9.54); groups of 16 over 3 ranges, and 8 over 12, fell to ~9.6 (the ranges' kernels
# then ran one after the other)
# (Bounding how far first ranges run ahead, stream priorities by range and splits shifted off the attention
# layers were measured too, `chunk_groups-sweep2..5-*`, and did not pay; they are gone since.)
GROUP_STAGES = 4
# a prompt's tail (the 1..grid ids above its last grid line) runs in the graph of the smallest multiple of this
# many rows that holds it, the rows past it padding (Step.valid): one graph per class instead of one per length,
# and at most TAIL_CLASS - 1 rows of work wasted (an eager tail of a few ids costs the 9B about what a whole
# chunk's graph does: the host launches its kernels slower than the device runs them)
TAIL_CLASS = 64


def capture_mode(engine, graphs: bool | str | None, who: str, error: type[Exception] = ValueError) -> bool | None:
    """What a user of graphs asked for, made concrete: True (CUDA graphs), False (the static CPU rehearsal,
    graphs="static") or None (eager). graphs=None: CUDA graphs where the device is CUDA and the kernels are
    qse's; True on another device is an error."""
    if graphs == "static":
        return False
    cuda = engine.device.type == "cuda"
    if graphs is None:
        graphs = cuda and engine.kernels != "naive"
    if not graphs:
        return None
    if not cuda:
        raise error(f"CUDA graphs asked for {who}, but it runs on {engine.device}")
    return True


class StaticPagedKV:
    """The page table in one fixed buffer (as long as the pool): what a captured forward reads."""

    def __init__(self, pool: KVPool):
        self.pool = pool
        self.table = torch.zeros(pool.num_pages, dtype=torch.int32, device=pool.k.device)

    def device_table(self) -> torch.Tensor:
        return self.table

    def ensure(self, length: int) -> bool:  # the session's own store makes room before a load
        return True

    def load(self, kv: PagedKV) -> None:
        if kv.pages:
            self.table[: len(kv.pages)].copy_(kv.device_table())


@dataclass
class _Entry:
    replay: Callable[[], Any]
    out: Any = None
    # what the captured graph reads and writes beyond the buffers this object owns (a group's starts and
    # offsets): a graph holds raw addresses, so these must live as long as it does
    holds: Any = None


def layer_bounds(num_layers: int, stages: int) -> list[int]:
    """The first layer of each of `stages` ranges, and num_layers: ranges as even as whole layers allow."""
    return [round(i * num_layers / stages) for i in range(stages + 1)]


class ForwardGraphs:
    def __init__(self, model, pool: KVPool, capture: bool | None = None, max_tokens: int = 1024):
        self.model = model
        self.pool = pool
        self.device = pool.k.device
        self.capture = (self.device.type == "cuda") if capture is None else capture
        if self.capture and self.device.type != "cuda":
            raise RuntimeError("CUDA graphs need a CUDA device")
        self.max_tokens = max_tokens
        self.kv = StaticPagedKV(pool)
        self.cache = model.new_cache(kv=self.kv)  # the working GDN state
        self.start = torch.zeros(1, dtype=torch.int32, device=self.device)
        self.logit_row = torch.zeros(1, dtype=torch.long, device=self.device)
        self.valid = torch.zeros(1, dtype=torch.long, device=self.device)  # a padded tail's real rows
        self._ids: dict[int, torch.Tensor] = {}
        self._ids_host: dict[int, torch.Tensor] = {}  # pinned staging for host ids (stage)
        self._ids_sent: dict[int, Any] = {}  # the event after the last copy out of each staging buffer
        self._entries: dict[tuple, _Entry] = {}
        self._hidden: dict[int, torch.Tensor] = {}  # a tapped read's final hiddens [rows, H], by its rows
        self._sides: list = []  # the side streams of chunk groups
        self._graph_pool = torch.cuda.graph_pool_handle() if self.capture else None
        self._clock = DeviceClock(self.device)
        # warm-up and capture run the forward for real: their KV rows go to pages of their own
        self._scratch: list[int] = []
        if self.capture:
            got = pool.allocate(-(-max_tokens // pool.page_rows))
            if got is None:
                raise MemoryError(f"the KV pool ({pool.num_pages} pages) has no room for the graphs' scratch pages")
            self._scratch = got

    @property
    def capacity(self) -> int:
        """The most rows a session can hold in this pool: what a captured attention launch is sized for."""
        return self.pool.num_pages * self.pool.page_rows

    @property
    def num_graphs(self) -> int:
        return len(self._entries) if self.capture else 0

    def release(self) -> None:
        """Give the scratch pages back and drop the graphs."""
        self._entries.clear()
        if self._scratch:
            self.pool.release(self._scratch)
            self._scratch = []

    def supports(self, num_tokens: int) -> bool:
        return 1 <= num_tokens <= self.max_tokens

    def tail_rows(self, num_tokens: int) -> int:
        """The rows a tail of `num_tokens` ids is read with (its class: the rows past it are padding): what its
        cache's pages must hold above its start."""
        if not 1 <= num_tokens <= self.max_tokens:
            raise ValueError(f"a tail is 1..{self.max_tokens} ids, not {num_tokens}")
        return min(self.max_tokens, -(-num_tokens // TAIL_CLASS) * TAIL_CLASS)

    # ---- the callers' verbs -------------------------------------------------------------------
    def warm(self, rows: int, group: int = 1, hidden: bool = False) -> None:
        """Capture now, rather than on the first read, the graphs reading chunks of `rows` rows: one chunk,
        and groups of 2, 4, ... up to `group` chunks (every group size a launch may take). A group the KV pool
        or the device has no room to capture is left out: launches then read the groups that fit (`can_group`
        says so), never fail for it. hidden: the one-chunk read with the final-hidden taps instead (run_chunks;
        no groups then)."""
        self._prepare(rows, "none", hidden)
        if hidden:
            return
        count = 2
        while count <= group and self.can_group(count, rows):
            count *= 2

    def warm_tails(self, max_tail: int, hidden: bool = False) -> None:
        """Capture now the tail graphs of every class up to `max_tail` ids (a served book: its grid); `hidden`:
        the ones that also give their rows' final hiddens (run_tail's)."""
        for rows in sorted({self.tail_rows(n) for n in range(1, max_tail + 1)}):
            self._prepare_tail(rows, hidden)

    def can_group(self, num_chunks: int, rows: int) -> bool:
        """Whether a group of `num_chunks` chunks of `rows` rows can run: its graph is captured (on first
        use). False when the pool has no room for the capture's scratch pages or the device no memory for
        the capture (the caller reads one chunk instead); a shape no group takes is a ValueError."""
        try:
            self._prepare_group(num_chunks, rows)
        except (MemoryError, torch.cuda.OutOfMemoryError):
            return False
        return True

    def run_chunks(self, cache: SequenceCache, ids: list[int] | torch.Tensor, start: int, chunks: int = 1,
                   hidden: bool = False) -> Any:
        """Read `ids` at `start` into `cache` (its GDN state and its KV rows; cache.length becomes start +
        len(ids)): one chunk, or `chunks` > 1 chunks of len(ids) / chunks rows in one group. The cache's
        pages must already hold the rows (kv.ensure). Never waits on the device. Returns a device mark
        taken after any capture, before the read's first device work: with a launch still in flight it
        stamps when the device comes to this one (time it with DeviceClock.ms against a mark after).
        hidden (one chunk): its rows' final hiddens too, into `final_hidden(len(ids))` (the last layer's MLP and
        the final norm run as well; the state and the KV rows are the same bits)."""
        if hidden and chunks != 1:
            raise ValueError(f"a read with the final-hidden taps reads one chunk; got {chunks}")
        if chunks == 1:
            entry = self._prepare(len(ids), "none", hidden)
        elif chunks > 1 and len(ids) % chunks == 0:
            entry = self._prepare_group(chunks, len(ids) // chunks)
        else:
            raise ValueError(f"a read of {len(ids)} ids cannot split into {chunks} equal chunks")
        begin = self._clock.mark()
        self._stage(ids, start)  # first: the host's share goes out before the device's
        self._load(cache)
        self._replay(entry)
        self._store(cache)
        cache.length = start + len(ids)
        return begin

    def answer(self, cache: SequenceCache, ids: list[int], pos: int, logit_row: int) -> tuple[torch.Tensor, float]:
        """A question's forward: `ids` at `pos` over the cache's state, on the working copy (the cache's
        GDN state is not written; its KV rows from `pos` are, so its pages must hold them). Returns row
        `logit_row`'s logits (a copy, fp32 [vocab]) and the device ms of the forward, state copy included
        and any capture excluded (waits for the device)."""
        entry = self._prepare(len(ids), "row")
        watch = Stopwatch(self.device)
        with watch.measure():
            self._stage(ids, pos, logit_row)
            self._load(cache)
            logits = self._replay(entry)[0].clone()
        return logits, watch.gpu_ms

    def run_tail(self, cache: SequenceCache, ids: list[int], start: int,
                 hidden: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A prompt's tail: `ids` at `start` into `cache` (its GDN state, its KV rows; cache.length becomes
        start + len(ids)), read in its class's graph (`tail_rows`) with the rows past the ids padding, which
        write KV rows up to start + tail_rows(len(ids)) (the cache's pages must hold them: kv.ensure) and
        step no state. Returns the last id's logits (fp32 [1, vocab], a copy) and with `hidden` the ids' final
        hiddens ([len(ids), H], a copy; else None); never waits on the device.
        The real rows' results are a forward of `tail_rows` rows' (the GEMMs see that many), so every read of
        a tail, cold or cached, takes this path to give the same bits."""
        num_tokens = len(ids)
        rows = self.tail_rows(num_tokens)
        entry = self._prepare_tail(rows, hidden)
        self._stage([*ids, *([ids[-1]] * (rows - num_tokens))], start, num_tokens - 1)
        self.valid.fill_(num_tokens)
        self._load(cache)
        logits = self._replay(entry).clone()
        finals = self._hidden[rows][:num_tokens].clone() if hidden else None
        self._store(cache)
        cache.length = start + num_tokens
        return logits, finals

    def final_hidden(self, num_tokens: int) -> torch.Tensor:
        """The final hiddens [num_tokens, H] of the last read of that many rows with the taps (run_chunks
        hidden=True): a buffer the next such read overwrites (queue device work on it before then)."""
        return self._hidden[num_tokens]

    @contextmanager
    def decoding(self, cache: SequenceCache) -> Iterator["ForkDecode"]:
        """Greedy decode on a fork of `cache`: the one-row graph captured on entry, the cache's GDN state
        loaded into the working copy at the fork's first forward and never stored back (the cache's KV
        rows from the fork's first position are the fork's own: drop them after). Nothing else may run on
        these graphs inside the block."""
        fork = ForkDecode(self, cache, self._prepare(1, "last"))
        try:
            yield fork
        finally:
            fork.closed = True

    # ---- the working state -------------------------------------------------------------------
    def _load(self, cache: SequenceCache) -> None:
        """The session's GDN state into the working copy, its pages into the table."""
        self.cache.copy_state_from(cache)
        self.kv.load(cache.kv)

    def _store(self, cache: SequenceCache) -> None:
        cache.copy_state_from(self.cache)

    # ---- replays -----------------------------------------------------------------------------
    def _prepare(self, num_tokens: int, logits: str, hidden: bool = False) -> _Entry:
        """The entry for this shape, captured on first use (hidden: with the final-hidden taps into a buffer of
        this object's). Call before `_load`: a capture runs the forward on the working state and the scratch
        pages."""
        if not self.supports(num_tokens):
            raise ValueError(f"graphs serve 1..{self.max_tokens} rows, not {num_tokens}")
        key = (num_tokens, logits, "final_hidden") if hidden else (num_tokens, logits)
        entry = self._entries.get(key)
        if entry is None:
            ids = self._ids.setdefault(num_tokens, torch.zeros(num_tokens, dtype=torch.long, device=self.device))
            step = Step(self.start, num_tokens, None, self.logit_row, self.capacity)
            taps = None
            if hidden:  # (owned here: a captured graph keeps only the buffer's address)
                taps = {"final_hidden": self._hidden.setdefault(
                    num_tokens, self.model.new_taps(num_tokens, ("final_hidden",))["final_hidden"])}

            def forward() -> Any:
                if taps is None:
                    return self.model.forward_step(ids, self.cache, step, logits)
                return self.model.forward_step(ids, self.cache, step, logits, taps=taps)

            entry = self._capture(forward) if self.capture else _Entry(forward)
            self._entries[key] = entry
        return entry

    def _prepare_tail(self, rows: int, hidden: bool = False) -> _Entry:
        """The entry of a padded tail of `rows` rows (logits of the row `logit_row`, rows from `valid` on
        padding; with `hidden` every row's final hidden into `_hidden[rows]` too), captured on first use. Call
        before `_load`, as `_prepare`."""
        key = ("tail", rows, hidden)
        entry = self._entries.get(key)
        if entry is None:
            ids = self._ids.setdefault(rows, torch.zeros(rows, dtype=torch.long, device=self.device))
            step = Step(self.start, rows, None, self.logit_row, self.capacity, valid=self.valid)
            taps = None
            if hidden:  # (owned here: a captured graph keeps only the buffer's address)
                taps = {"final_hidden": self._hidden.setdefault(
                    rows, self.model.new_taps(rows, ("final_hidden",))["final_hidden"])}

            def forward() -> Any:
                return self.model.forward_step(ids, self.cache, step, "row", taps=taps)

            self.valid.fill_(rows)
            entry = self._capture(forward) if self.capture else _Entry(forward)
            self._entries[key] = entry
        return entry

    def _prepare_group(self, num_chunks: int, rows: int, stages: int | None = None) -> _Entry:
        """The entry reading `num_chunks` chunks of `rows` rows at start, start + rows, ... in one replay
        (logits "none"; stage all their ids at once), the layers in `stages` ranges on as many streams
        (None: GROUP_STAGES). Call before `_load`, as `_prepare`."""
        stages = GROUP_STAGES if stages is None else stages
        num_layers = len(self.model.cfg.layer_types)
        if num_chunks < 2 or not self.supports(rows) or num_chunks * rows > (1 << 20):
            raise ValueError(f"a chunk group is 2 or more chunks of 1..{self.max_tokens} rows; got {num_chunks} x {rows}")
        if not 2 <= stages <= num_layers:
            raise ValueError(f"a chunk group runs its layers in 2..{num_layers} ranges; got {stages}")
        key = ("group", num_chunks, rows, stages)
        entry = self._entries.get(key)
        if entry is None:
            ids = self._ids.setdefault(num_chunks * rows, torch.zeros(num_chunks * rows, dtype=torch.long, device=self.device))
            starts = torch.zeros(num_chunks, dtype=torch.int32, device=self.device)
            offsets = torch.arange(num_chunks, dtype=torch.int32, device=self.device) * rows
            steps = [Step(starts[i:i + 1], rows, None, self.logit_row, self.capacity) for i in range(num_chunks)]
            chunk_ids = [ids[i * rows:(i + 1) * rows] for i in range(num_chunks)]
            bounds = layer_bounds(num_layers, stages)

            def forward() -> None:
                torch.add(self.start, offsets, out=starts)  # each chunk's start, on the device
                self._skewed(chunk_ids, steps, bounds)

            if self.capture:
                self._scratch_for(num_chunks * rows)
            # a pool of its own: the group's side streams allocate in it, and no other graph's capture takes
            # a block one of them freed
            entry = self._capture(forward, torch.cuda.graph_pool_handle()) if self.capture else _Entry(forward)
            entry.holds = (starts, offsets, forward)
            self._entries[key] = entry
        return entry

    def _scratch_for(self, rows: int) -> None:
        """Scratch pages for a capture of `rows` rows (its warm-up and capture write real KV rows through the
        table: past the scratch pages they would land on whatever page the table names)."""
        need = -(-rows // self.pool.page_rows) - len(self._scratch)
        if need > 0:
            got = self.pool.allocate(need)
            if got is None:
                raise MemoryError(f"the KV pool ({self.pool.num_pages} pages) has no room for {need} more scratch pages")
            self._scratch += got

    def _skewed(self, chunk_ids: list[torch.Tensor], steps: list[Step], bounds: list[int]) -> None:
        """The group's forward: layer range s of every chunk on stream s (the last range on the current
        stream), range s of chunk i after range s-1 of chunk i has handed over. Without CUDA, the same calls
        one after the other."""
        model, ranges = self.model, list(zip(bounds[:-1], bounds[1:]))
        if self.device.type != "cuda":
            for ids, step in zip(chunk_ids, steps):
                data = ids
                for first, stop in ranges:
                    data = model.forward_layers(data, self.cache, step, "none", first, stop)
            return
        main = torch.cuda.current_stream(self.device)
        while len(self._sides) < len(ranges) - 1:
            self._sides.append(torch.cuda.Stream(self.device))
        sides = self._sides[: len(ranges) - 1]
        streams = [*sides, main]
        for side in sides:
            side.wait_stream(main)
        handed = []  # every hand-over stays referenced until the join: no block of one is reused mid-group
        for ids, step in zip(chunk_ids, steps):
            data, ready = ids, None
            for stream, (first, stop) in zip(streams, ranges):
                with torch.cuda.stream(stream):
                    if ready is not None:
                        stream.wait_event(ready)
                    data = model.forward_layers(data, self.cache, step, "none", first, stop)
                    if stream is not main:
                        ready = torch.cuda.Event()
                        ready.record(stream)
                handed.append(data)
        for side in sides:
            main.wait_stream(side)

    def _capture(self, forward: Callable[[], Any], pool: Any = None) -> _Entry:
        """The entry of `forward` captured as a graph, in `pool` (None: the pool the single forwards share)."""
        self.kv.table[: len(self._scratch)].copy_(torch.tensor(self._scratch, dtype=torch.int32))
        self.start.zero_()
        self.logit_row.zero_()
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side), torch.inference_mode():
            for _ in range(2):  # compiles the kernels, sizes cuBLAS's workspace
                forward()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the served model's thread may launch work while the reader's thread captures
        with torch.inference_mode(), torch.cuda.graph(graph, pool=pool or self._graph_pool,
                                                      capture_error_mode="thread_local"):
            out = forward()
        return _Entry(graph.replay, out)

    def _stage(self, ids: list[int] | torch.Tensor, pos: int, logit_row: int = 0) -> None:
        """The replay's inputs (ids, start, logit row) into the buffers it reads, without waiting on the
        device: host ids go through a pinned buffer by an asynchronous copy (a pageable copy synchronises
        the stream, and the GPU then idles while the host goes on to launch the replay)."""
        num_tokens = len(ids)
        dst = self._ids[num_tokens]
        if isinstance(ids, torch.Tensor) and ids.device == dst.device:
            dst.copy_(ids)
        elif self.device.type == "cuda":
            host = self._ids_host.get(num_tokens)
            if host is None:
                host = self._ids_host[num_tokens] = torch.empty(num_tokens, dtype=torch.long, pin_memory=True)
                self._ids_sent[num_tokens] = torch.cuda.Event()
            self._ids_sent[num_tokens].synchronize()  # the last copy out of this buffer is done
            host.copy_(torch.as_tensor(ids, dtype=torch.long))
            dst.copy_(host, non_blocking=True)
            self._ids_sent[num_tokens].record()
        else:
            dst.copy_(torch.as_tensor(ids, dtype=torch.long))
        self.start.fill_(pos)
        self.logit_row.fill_(logit_row)

    def _replay(self, entry: _Entry) -> Any:
        """Replay `entry` on the working state and the staged inputs; returns its output buffer."""
        out = entry.replay()
        return entry.out if self.capture else out

    def _forward_eager(self, ids: list[int], pos: int, logits: str) -> Any:
        """An eager forward on the working state (a shape no graph serves, e.g. a summary's prompt)."""
        self.start.fill_(pos)
        step = Step(self.start, len(ids), pos, self.logit_row, pos + len(ids))
        with torch.inference_mode():
            return self.model.forward_step(torch.as_tensor(ids, dtype=torch.long).to(self.device), self.cache, step, logits)


class ForkDecode:
    """One fork's decode on ForwardGraphs' working copy (from `ForwardGraphs.decoding`): the first forward
    loads the session's GDN state (inside whatever the caller times), every forward steps the working copy,
    and nothing is stored back."""

    def __init__(self, graphs: ForwardGraphs, cache: SequenceCache, entry: _Entry):
        self._graphs, self._cache, self._entry = graphs, cache, entry
        self._loaded = False
        self.closed = False

    def _ready(self) -> ForwardGraphs:
        if self.closed:
            raise RuntimeError("this fork's decode has ended: open another with ForwardGraphs.decoding")
        if not self._loaded:
            self._graphs._load(self._cache)
            self._loaded = True
        return self._graphs

    def prefill(self, ids: list[int], pos: int) -> Any:
        """An eager forward of `ids` at `pos` (any length; a shape no graph serves); the last row's logits."""
        return self._ready()._forward_eager(ids, pos, "last")

    def __call__(self, ids: list[int] | torch.Tensor, pos: int) -> Any:
        """One decode step: the token `ids` (one id; a device tensor may be the last step's on-device argmax)
        at `pos` through the one-row graph, without waiting on the device. Returns the logits buffer
        [1, vocab], overwritten by the next step: read it, or queue device work on it, before then."""
        if len(ids) != 1:
            raise ValueError(f"a decode step reads one token, not {len(ids)}")
        graphs = self._ready()
        graphs._stage(ids, pos)
        return graphs._replay(self._entry)


__all__ = ["ForkDecode", "ForwardGraphs", "StaticPagedKV", "capture_mode"]
