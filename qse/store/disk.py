"""One parked session, one safetensors file: its whole state, checkpoints, ids and fingerprints.

    <dir>/<sha256(session id)>.safetensors      (the id itself is stored inside)
    [u64 header length][header JSON: __metadata__ first, then one entry a tensor][tensor bytes]

    tensors   ids                              int32 [num_ids]   everything the session knew
              ckpt.<i>.recurrent.<j>, ckpt.<i>.conv.<j>          checkpoint i's GDN state (positions in metadata)
              state.s.<name>, state.v.<name>                     the ModelState (sections, KV views)
    metadata  format, version, the fingerprints (weights, grid, signature, kernel), session_id,
              committed, checkpoints, checkpoint_lines, mode, stats, written_s, ids_sha256, checksum(_block)

The file is the safetensors layout (any safetensors reader opens it), written here so that it can
stream, hash and sync: it goes to a temporary name in the same directory, is fsynced, renamed into
place, and the directory is fsynced, so a reader sees no file or a whole one. The checksum covers
every byte of the file: sha256 over the head (length prefix and header, with the checksum's own 64
characters read as '0') followed by the sha256 digests of each tensor's bytes in blocks of
`checksum_block` bytes (the blocks are hashed on a thread pool while the file is written or read;
one sha256 stream runs at about 1.3 GB/s, slower than the disk). A file is read only when its
format, version and every fingerprint match and the checksum holds; anything else is a `FileMiss`
carrying one reason from `MISS_REASONS`.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import secrets
import struct
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

FORMAT = "qse.shadow.session"
VERSION = 1
SUFFIX = ".safetensors"
TMP_SUFFIX = ".tmp"
CHECKSUM_KEY = "checksum"
_ZERO_DIGEST = "0" * 64
_DIGEST_MARK = f'"{CHECKSUM_KEY}":"'.encode()
_MAX_HEADER_NBYTES = 100 << 20
_IO_BLOCK = 64 << 20
HASH_BLOCK = 16 << 20
_INLINE_HASH_NBYTES = 4 << 20
_STREAM_MIN_NBYTES = 4 << 20  # GPU tensors from this size go through the pinned staging buffers
_hash_pool: ThreadPoolExecutor | None = None
_hash_pool_lock = threading.Lock()

# why a file was not read back (or not written): the keys of the store's miss counts
MISS_REASONS = (
    "empty", "truncated", "corrupt", "checksum", "format", "version", "weights", "grid", "signature", "kernel",
    "session_id", "unreadable", "missing", "no_room",  # reading
    "disk_full", "read_only", "write_error", "disk_cap",  # writing
)

_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}
_CODES = {code: dtype for dtype, code in _DTYPES.items()}


class FileMiss(Exception):
    """A parked file that cannot be used (or written); `reason` is one of MISS_REASONS."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class Fingerprint:
    """What must match for a parked state to continue exactly on this reader."""

    weights_id: str
    grid: int
    signature: str  # the engine's StateManifest signature: state tensor names, shapes and dtypes
    kernel: str  # kernels, torch build and device that wrote the state

    def metadata(self) -> dict[str, str]:
        return {"weights_id": self.weights_id, "grid": str(self.grid), "signature": self.signature, "kernel": self.kernel}

    def check(self, meta: dict[str, str]) -> None:
        """Raise FileMiss naming the first fingerprint that differs."""
        for reason, key, mine in (("weights", "weights_id", self.weights_id), ("grid", "grid", str(self.grid)),
                                  ("signature", "signature", self.signature), ("kernel", "kernel", self.kernel)):
            theirs = meta.get(key)
            if theirs != mine:
                raise FileMiss(reason, f"file has {key}={theirs!r}, this reader {mine!r}")


def kernel_fingerprint(device: torch.device, ops: str | None = None, model: object | None = None) -> str:
    """What decides a state's bits, and nothing else: the sources of the kernels the op set runs (and Triton's
    version where it runs Triton), the op set (naive, triton, invariant), the source of the model's forward
    (which ops it calls on what: a fused projection rounds unlike its parts), the torch build and the device
    model, or on a CPU the vector capability torch's kernels use (AVX-512 rounds unlike AVX2): a state
    continues exactly only on the same arithmetic."""
    import inspect

    import qse_kernels

    fn = getattr(qse_kernels, "kernel_fingerprint", None)
    base = str(fn(ops or "naive")) if callable(fn) else "qse_kernels:unversioned"
    if model is not None:
        source = inspect.getsourcefile(type(model))
        digest = hashlib.sha256(Path(source).read_bytes()).hexdigest()[:16] if source else "unknown"
        base += f"|forward-{type(model).__name__}-{digest}"
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        where = f"cuda:{torch.cuda.get_device_name(device)}:sm{major}{minor}"
    elif device.type == "cpu":
        where = f"cpu:{torch.backends.cpu.get_cpu_capability()}"
    else:
        where = device.type
    return f"{base}|ops-{ops or 'naive'}|torch-{torch.__version__}|{where}"


def file_name(session_id: str) -> str:
    """Session ids may hold any characters; the file is named by their hash."""
    return hashlib.sha256(session_id.encode("utf-8", "surrogatepass")).hexdigest() + SUFFIX


def is_temp_name(name: str) -> bool:
    return name.startswith(".") and name.endswith(TMP_SUFFIX)


def write_reason(exc: OSError) -> str:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return "disk_full"
    if exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        return "read_only"
    return "write_error"


# ---- writing ---------------------------------------------------------------------------------
def _tensor_bytes(t: torch.Tensor) -> memoryview:
    flat = t.detach().reshape(-1).contiguous().cpu()
    return memoryview(flat.view(torch.uint8).numpy())


def _hashers() -> ThreadPoolExecutor:
    global _hash_pool
    with _hash_pool_lock:
        if _hash_pool is None:
            _hash_pool = ThreadPoolExecutor(max_workers=max(1, min(8, (os.cpu_count() or 2) - 1)),
                                            thread_name_prefix="qse-store-hash")
        return _hash_pool


def _digest(view: memoryview) -> bytes:
    return hashlib.sha256(view).digest()  # releases the GIL on large buffers


def _hash_blocks(data: memoryview, block: int) -> list[Future | bytes]:
    """Digests of data's blocks: large ones on the pool, small ones here (a handoff costs more)."""
    if data.nbytes < _INLINE_HASH_NBYTES:
        return [_digest(data[i : i + block]) for i in range(0, data.nbytes, block)]
    pool = _hashers()
    return [pool.submit(_digest, data[i : i + block]) for i in range(0, data.nbytes, block)]


def _checksum(head: bytes, digests: list[Future | bytes]) -> str:
    return hashlib.sha256(head + b"".join(d if isinstance(d, bytes) else d.result() for d in digests)).hexdigest()


class _Staging:
    """Two pinned host buffers that stream a GPU tensor to a file or back, chunk by chunk, so that
    the copy of one chunk overlaps the write (or read) and hashing of the other. Pageable copies
    run at 1.7 GB/s device-to-host on a fresh host allocation; pinned ones at the bus's speed."""

    NBYTES = 64 << 20  # a multiple of HASH_BLOCK: chunk edges are block edges

    def __init__(self) -> None:
        self.bufs = [torch.empty(self.NBYTES, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        self.views = [memoryview(b.numpy()) for b in self.bufs]
        self.hashing: list[list[Future]] = [[], []]  # digests still reading each buffer
        self.copied: list[torch.cuda.Event | None] = [None, None]  # host-to-device copies still reading it

    def free(self, i: int) -> None:
        for fut in self.hashing[i]:
            fut.result()
        self.hashing[i] = []
        if self.copied[i] is not None:
            self.copied[i].synchronize()
            self.copied[i] = None

    def held(self, i: int, digests: list[Future | bytes]) -> None:
        self.hashing[i] = [d for d in digests if isinstance(d, Future)]


_staging: _Staging | None = None
_staging_lock = threading.Lock()


def prepare_staging() -> None:
    """Pin the staging buffers now (a store meeting its CUDA device, at start): a first pinned allocation
    holds every thread's CUDA calls while it runs, so it should not happen during the first load."""
    with _staging_lock:
        _stager()


def _stager() -> _Staging:
    global _staging
    if _staging is None:
        _staging = _Staging()
    return _staging


def _write_from_gpu(fd: int, t: torch.Tensor, block: int, digests: list[Future | bytes]) -> int:
    flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
    n = flat.numel()
    with _staging_lock:
        st = _stager()
        step = _Staging.NBYTES
        chunks = [(o, min(step, n - o)) for o in range(0, n, step)]
        ready: list[torch.cuda.Event | None] = [None, None]

        def fetch(k: int) -> None:
            i = k % 2
            st.free(i)
            o, m = chunks[k]
            st.bufs[i][:m].copy_(flat[o : o + m], non_blocking=True)
            ready[i] = torch.cuda.Event()
            ready[i].record()

        fetch(0)
        for k, (_, m) in enumerate(chunks):
            if k + 1 < len(chunks):
                fetch(k + 1)
            i = k % 2
            ready[i].synchronize()
            view = st.views[i][:m]
            ds = _hash_blocks(view, block)
            st.held(i, ds)
            digests += ds
            _write_all(fd, view)
        for i in (0, 1):
            st.free(i)
    return n


def _read_to_gpu(f, e: "Entry", device: torch.device, block: int, digests: list[Future | bytes] | None) -> torch.Tensor:
    n = e.end - e.start
    dst = torch.empty(n, dtype=torch.uint8, device=device)
    with _staging_lock:
        st = _stager()
        step = _Staging.NBYTES // block * block
        for k, o in enumerate(range(0, n, step)):
            i, m = k % 2, min(step, n - o)
            st.free(i)
            view = st.views[i][:m]
            _readinto_exact(f, view)
            if digests is not None:
                ds = _hash_blocks(view, block)
                st.held(i, ds)
                digests += ds
            dst[o : o + m].copy_(st.bufs[i][:m], non_blocking=True)
            st.copied[i] = torch.cuda.Event()
            st.copied[i].record()
        for i in (0, 1):
            st.free(i)
    return dst.view(e.dtype).reshape(e.shape)


def _write_all(fd: int, data: memoryview) -> None:
    view = data.cast("B") if data.format != "B" else data
    while len(view):
        n = os.write(fd, view[:_IO_BLOCK])
        view = view[n:]


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _header_bytes(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> bytes:
    meta = {CHECKSUM_KEY: _ZERO_DIGEST, "checksum_block": str(HASH_BLOCK),
            **{k: v for k, v in metadata.items() if k not in (CHECKSUM_KEY, "checksum_block")}}
    entries: dict[str, object] = {"__metadata__": meta}
    offset = 0
    for name, t in tensors.items():
        if t.dtype not in _DTYPES:
            raise TypeError(f"tensor {name!r} has dtype {t.dtype}, which a parked file cannot hold")
        n = t.numel() * t.element_size()
        entries[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    header = json.dumps(entries, separators=(",", ":")).encode()  # ASCII: json escapes the rest
    return header + b" " * (-len(header) % 8)


def write_file(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str], sync: bool = True) -> int:
    """Write tensors and metadata to `path` atomically (temp name, fsync, rename, fsync dir).

    sync=False leaves out both fsyncs: the file survives a killed process (the page cache has it) and
    is never torn (the rename is atomic), but a power loss may lose the newest write.

    Returns the file's size. Raises OSError when the disk refuses; the temporary file is removed
    then, and whatever was at `path` before is untouched.
    """
    path = Path(path)
    header = _header_bytes(tensors, metadata)
    prefix = struct.pack("<Q", len(header))
    digest_at = len(prefix) + header.index(_DIGEST_MARK) + len(_DIGEST_MARK)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}{TMP_SUFFIX}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        _write_all(fd, memoryview(prefix + header))
        size = len(prefix) + len(header)
        futures: list[Future | bytes] = []
        for t in tensors.values():
            if t.device.type == "cuda" and t.numel() * t.element_size() >= _STREAM_MIN_NBYTES:
                size += _write_from_gpu(fd, t, HASH_BLOCK, futures)
                continue
            data = _tensor_bytes(t)
            futures += _hash_blocks(data, HASH_BLOCK)
            _write_all(fd, data)
            size += data.nbytes
        digest = _checksum(prefix + header, futures).encode()
        if os.pwrite(fd, digest, digest_at) != len(digest):
            raise OSError(errno.EIO, "short write of the checksum")
        if sync:
            os.fsync(fd)
    except BaseException:
        os.close(fd)
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    os.close(fd)
    try:
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    if sync:
        _fsync_dir(path.parent)
    return size


# ---- reading ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Entry:
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # offsets in the data section
    end: int


@dataclass(frozen=True)
class FileHeader:
    path: Path
    meta: dict[str, str]
    entries: dict[str, Entry]  # in file order
    data_start: int  # 8 + header length
    size: int
    hashed_head: bytes  # length prefix + header with the checksum read as zeros
    hash_block: int  # bytes per hashed block of a tensor


def read_header(path: Path) -> FileHeader:
    """Parse and check the header: format, version, layout and sizes (not the fingerprints)."""
    path = Path(path)
    try:
        with open(path, "rb", buffering=0) as f:
            size = os.fstat(f.fileno()).st_size
            if size == 0:
                raise FileMiss("empty", "zero-length file")
            prefix = f.read(8)
            if len(prefix) < 8:
                raise FileMiss("truncated", f"{size} bytes, shorter than the length prefix")
            (n,) = struct.unpack("<Q", prefix)
            if n > _MAX_HEADER_NBYTES:
                raise FileMiss("corrupt", f"header length {n} is not plausible")
            if 8 + n > size:
                raise FileMiss("truncated", f"header of {n} bytes, file of {size}")
            header = _read_exact(f, n)
    except FileNotFoundError:
        raise FileMiss("missing", str(path)) from None
    except IsADirectoryError:
        raise FileMiss("unreadable", f"{path} is a directory") from None
    except OSError as exc:
        raise FileMiss("unreadable", f"{exc.strerror or exc}") from None
    try:
        raw = json.loads(header.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise FileMiss("corrupt", f"header is not JSON ({exc})") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("__metadata__"), dict):
        raise FileMiss("corrupt", "header has no __metadata__")
    meta = raw.pop("__metadata__")
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise FileMiss("corrupt", "metadata values must be strings")
    if meta.get("format") != FORMAT:
        raise FileMiss("format", f"format {meta.get('format')!r}, expected {FORMAT!r}")
    if meta.get("version") != str(VERSION):
        raise FileMiss("version", f"format version {meta.get('version')!r}, this build reads {VERSION}")
    entries = _parse_entries(raw)
    data_nbytes = max((e.end for e in entries.values()), default=0)
    if 8 + n + data_nbytes > size:
        raise FileMiss("truncated", f"tensors end at {8 + n + data_nbytes}, the file at {size}")
    if 8 + n + data_nbytes < size:
        raise FileMiss("corrupt", f"{size - 8 - n - data_nbytes} bytes after the last tensor")
    mark = header.find(_DIGEST_MARK)
    digest = header[mark + len(_DIGEST_MARK) : mark + len(_DIGEST_MARK) + 64] if mark >= 0 else b""
    if mark < 0 or digest.decode("ascii", "replace") != meta.get(CHECKSUM_KEY):
        raise FileMiss("corrupt", "checksum field is not where it was written")
    at = mark + len(_DIGEST_MARK)
    zeroed = header[:at] + _ZERO_DIGEST.encode() + header[at + 64 :]
    block = meta.get("checksum_block", "")
    if not block.isdigit() or not 4096 <= int(block) <= 1 << 30:
        raise FileMiss("corrupt", f"checksum_block {block!r} is not a plausible block size")
    return FileHeader(path, meta, entries, 8 + n, size, prefix + zeroed, int(block))


def _parse_entries(raw: dict) -> dict[str, Entry]:
    entries: dict[str, Entry] = {}
    try:
        for name, spec in raw.items():
            dtype = _CODES[spec["dtype"]]
            shape = tuple(int(d) for d in spec["shape"])
            start, end = (int(x) for x in spec["data_offsets"])
            if any(d < 0 for d in shape) or end - start != math.prod(shape) * _itemsize(dtype):
                raise ValueError(f"tensor {name!r}: offsets do not match its shape")
            entries[name] = Entry(dtype, shape, start, end)
    except (KeyError, TypeError, ValueError) as exc:
        raise FileMiss("corrupt", f"bad tensor entry ({exc})") from None
    ordered = sorted(entries.items(), key=lambda kv: kv[1].start)
    at = 0
    for name, e in ordered:
        if e.start != at:
            raise FileMiss("corrupt", f"tensor {name!r} starts at {e.start}, expected {at}")
        at = e.end
    return dict(ordered)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _read_exact(f, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = f.readinto(view[got:])
        if not k:
            raise FileMiss("truncated", f"file ended {n - got} bytes early")
        got += k
    return bytes(buf)


def _readinto_exact(f, view: memoryview) -> None:
    got = 0
    while got < len(view):
        k = f.readinto(view[got : got + _IO_BLOCK])
        if not k:
            raise FileMiss("truncated", f"file ended {len(view) - got} bytes early")
        got += k


def read_tensors(header: FileHeader, names: list[str] | None = None,
                 device: torch.device | None = None,
                 stream_min_nbytes: int = _STREAM_MIN_NBYTES) -> dict[str, torch.Tensor]:
    """The file's tensors. With `names` None every tensor is read and the checksum verified; with a
    list, only those tensors are read (no checksum: the caller verifies them otherwise). With a
    cuda `device`, large tensors stream through pinned buffers onto it; the rest stay on the CPU.
    stream_min_nbytes: the smallest tensor that goes to the device (0: every one; the store's loads,
    whose hundreds of small checkpoint tensors would otherwise each be a waited copy on the owner's thread)."""
    to_gpu = device is not None and device.type == "cuda" and _Staging.NBYTES >= header.hash_block
    wanted = list(header.entries) if names is None else names
    out: dict[str, torch.Tensor] = {}
    futures: list[Future | bytes] = []
    try:
        with open(header.path, "rb", buffering=0) as f:
            if os.fstat(f.fileno()).st_size != header.size:
                raise FileMiss("truncated" if os.fstat(f.fileno()).st_size < header.size else "corrupt",
                               "the file changed size since its header was read")
            f.seek(header.data_start)
            for name in wanted:
                e = header.entries.get(name)
                if e is None:
                    raise FileMiss("corrupt", f"no tensor {name!r}")
                if names is not None:
                    f.seek(header.data_start + e.start)
                if to_gpu and e.end - e.start >= stream_min_nbytes:
                    out[name] = _read_to_gpu(f, e, device, header.hash_block, futures if names is None else None)
                    continue
                buf = torch.empty(e.end - e.start, dtype=torch.uint8)
                view = memoryview(buf.numpy())
                _readinto_exact(f, view)
                if names is None:
                    futures += _hash_blocks(view, header.hash_block)
                out[name] = buf.view(e.dtype).reshape(e.shape) if buf.numel() else torch.empty(e.shape, dtype=e.dtype)
    except FileNotFoundError:
        raise FileMiss("missing", str(header.path)) from None
    except OSError as exc:
        raise FileMiss("unreadable", f"{exc.strerror or exc}") from None
    if names is None:
        digest = _checksum(header.hashed_head, futures)
        if digest != header.meta.get(CHECKSUM_KEY):
            raise FileMiss("checksum", f"sha256 {digest[:16]}..., the file says {header.meta.get(CHECKSUM_KEY, '')[:16]}...")
    return out


def tensor_sha256(t: torch.Tensor) -> str:
    return hashlib.sha256(_tensor_bytes(t)).hexdigest()


__all__ = ["FORMAT", "HASH_BLOCK", "MISS_REASONS", "VERSION", "Entry", "FileHeader", "FileMiss", "Fingerprint", "file_name",
           "is_temp_name", "kernel_fingerprint", "read_header", "read_tensors", "tensor_sha256", "write_file",
           "write_reason"]
