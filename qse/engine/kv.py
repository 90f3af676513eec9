"""Paged KV storage whose rows never move.

A KVPool is allocated once (its size is the reader's residency budget); sessions take fixed-size
pages from it and give them back. A session's rows keep their addresses as the session grows, so a
CUDA graph that reads through the page table stays valid. The pool deals only in integers (page
ids) for allocation, as the allocator answers None when something does not fit and the caller
decides (evict, park, or refuse).

    pool.k[page, slot, row, kv_head, dim]      one page = `page_rows` consecutive positions
    session.pages = [p0, p1, ...]              rows [i*page_rows, (i+1)*page_rows) live in page p_i
"""

from __future__ import annotations

import torch


class KVPool:
    def __init__(self, num_pages: int, page_rows: int, num_slots: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str):
        if num_pages < 1 or page_rows < 1:
            raise ValueError(f"a KV pool needs at least one page of at least one row, got {num_pages} x {page_rows}")
        self.page_rows = page_rows
        self.num_slots = num_slots
        shape = (num_pages, num_slots, page_rows, num_kv_heads, head_dim)
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out low ids first

    @classmethod
    def for_budget(cls, nbytes: int, page_rows: int, num_slots: int, num_kv_heads: int, head_dim: int,
                   dtype: torch.dtype, device: torch.device | str) -> "KVPool":
        page_bytes = cls.page_nbytes_for(page_rows, num_slots, num_kv_heads, head_dim, dtype)
        return cls(max(1, nbytes // page_bytes), page_rows, num_slots, num_kv_heads, head_dim, dtype, device)

    @staticmethod
    def page_nbytes_for(page_rows: int, num_slots: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * page_rows * num_slots * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    @property
    def num_pages(self) -> int:
        return self.k.shape[0]

    @property
    def page_nbytes(self) -> int:
        return 2 * self.k[0].numel() * self.k.element_size()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        if n > len(self._free):
            return None
        return [self._free.pop() for _ in range(n)]

    def copy_pages(self, src: list[int], dst: list[int]) -> None:
        """Pages dst[i] := pages src[i], every slot and row (one session's rows given to another: the rows of a
        shared head, GridSessions.start_from_donor); the two lists must not overlap."""
        if len(src) != len(dst):
            raise ValueError(f"copy_pages: {len(src)} source pages for {len(dst)} destinations")
        if not src:
            return
        device = self.k.device
        src_t = torch.tensor(src, dtype=torch.long, device=device)
        dst_t = torch.tensor(dst, dtype=torch.long, device=device)
        for store in (self.k, self.v):
            store.index_copy_(0, dst_t, store.index_select(0, src_t))

    def release(self, pages: list[int]) -> None:
        self._free.extend(reversed(pages))


class PagedKV:
    """One session's KV rows in a pool (implements qse.models.cache.KVStore)."""

    def __init__(self, pool: KVPool):
        self.pool = pool
        self.pages: list[int] = []
        self._table: torch.Tensor | None = None

    @property
    def capacity(self) -> int:
        return len(self.pages) * self.pool.page_rows

    @property
    def nbytes(self) -> int:
        return len(self.pages) * self.pool.page_nbytes

    def pages_for(self, length: int) -> int:
        return -(-length // self.pool.page_rows)

    def ensure(self, length: int) -> bool:
        missing = self.pages_for(length) - len(self.pages)
        if missing <= 0:
            return True
        got = self.pool.allocate(missing)
        if got is None:
            return False
        self.pages.extend(got)
        self._table = None
        return True

    def truncate(self, length: int) -> None:
        """Give back pages wholly above `length`; rows below stay where they are."""
        keep = self.pages_for(length)
        if keep < len(self.pages):
            self.pool.release(self.pages[keep:])
            del self.pages[keep:]
            self._table = None

    def release_all(self) -> None:
        self.truncate(0)

    def _segments(self, start: int, count: int):
        rows = self.pool.page_rows
        pos, end = start, start + count
        while pos < end:
            page_i, offset = divmod(pos, rows)
            take = min(rows - offset, end - pos)
            yield self.pages[page_i], offset, pos - start, take
            pos += take

    def write(self, slot: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        count = k.shape[0]
        if not self.ensure(start + count):
            raise MemoryError(f"KV pool has no room for rows up to {start + count}")
        rows = self.pool.page_rows
        first, offset = divmod(start, rows)
        full = count // rows if offset == 0 else 0
        if full > 1:  # whole pages in one indexed copy each (a restore writes a session's rows: one launch, not
            # one a page); the bytes are the same as page by page
            idx = self.device_table()[first : first + full].long()
            self.pool.k[idx, slot] = k[: full * rows].reshape(full, rows, *k.shape[1:])
            self.pool.v[idx, slot] = v[: full * rows].reshape(full, rows, *v.shape[1:])
            start, k, v = start + full * rows, k[full * rows :], v[full * rows :]
        for page, offset, src, take in self._segments(start, k.shape[0]):
            self.pool.k[page, slot, offset : offset + take] = k[src : src + take]
            self.pool.v[page, slot, offset : offset + take] = v[src : src + take]

    def read(self, slot: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = self.pages_for(length)
        if n == 1:
            p = self.pages[0]
            return self.pool.k[p, slot, :length], self.pool.v[p, slot, :length]
        idx = self.device_table()[:n].long()
        shape = (n * self.pool.page_rows, *self.pool.k.shape[3:])
        k = self.pool.k[idx, slot].reshape(shape)[:length]
        v = self.pool.v[idx, slot].reshape(shape)[:length]
        return k, v

    def device_table(self) -> torch.Tensor:
        """The page ids as an int32 tensor on the pool's device (rebuilt only when the pages change)."""
        if self._table is None:
            host = torch.tensor(self.pages or [0], dtype=torch.int32)
            device = self.pool.k.device
            if device.type == "cuda":
                # pinned and asynchronous: a pageable copy synchronises the stream, and a graph chunk
                # (a new page every grid chunk) then idled while the host caught up. The caching host
                # allocator keeps the pinned block until the copy has run.
                self._table = host.pin_memory().to(device, non_blocking=True)
            else:
                self._table = host.to(device)
        return self._table
