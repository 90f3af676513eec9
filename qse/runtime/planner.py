"""The residency planner: loads and releases the roles' models against the device's memory.

    qse serve: served model loaded (health 503 -> 200) -> the server answers at once
    first idle window after the start (no request runs or waits, no hold, no box lock):
        hold + box lock   admit the reader's claim (core.residency) -> load its weights (a worker thread)
        engine lock (behind every served request) + box lock
                          capture its graphs, attach it to the conductor (it learns the served sessions)
    release (admin route): engine lock + box lock -> park its sessions, detach, drop its pools (and its
                          weights unless the served model reads them too)

Who decides what fits is qse/core/residency.py (pure arithmetic); this module measures the memory, takes the
locks the conductor honours (the hold shuts the idle window; the box lock is the machine's "a model is
loading" lock) and carries the decision out. One copy of the weights where two roles name the same model:
the reader's loader is handed the served Engine itself (RoleLoader.build decides, not the planner).
"""

from __future__ import annotations

import asyncio
import gc
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import structlog

from ..core.locks import HeldLocks, Priority
from ..core.residency import GIB, Claim, Residency, RoleState, Verdict, gib

log = structlog.get_logger("qse.planner")


class ResidencyError(RuntimeError):
    """A role cannot be loaded or released now; the message says why (a claim that does not fit names it)."""

    def __init__(self, message: str, code: str = "residency"):
        super().__init__(message)
        self.code = code


@dataclass
class RoleLoader:
    """How to bring one role onto the device. build() runs on a worker thread and returns the role's object
    (for the reader: a ShadowReader with its store attached); warm(obj) captures its graphs under the engine
    lock; weights_nbytes(obj) measures what its weights hold (0 when it reads another role's weights)."""

    claim: Claim
    build: Callable[[], Any]
    warm: Callable[[Any], None]
    weights_nbytes: Callable[[Any], int]


class DeviceMemory:
    """Free memory and what this process drew from it: the GPU's own figures, else a budget on the CPU
    (QSE_DEVICE_MEMORY_GB, 0: the machine's memory) with nothing drawn, so that core counts every claim."""

    def __init__(self, device: Any, budget_nbytes: int = 0):
        self.device = device
        self.budget_nbytes = budget_nbytes

    @property
    def where(self) -> str:
        return str(self.device)

    @property
    def is_gpu(self) -> bool:
        return getattr(self.device, "type", str(self.device)) == "cuda"

    def total_and_free(self) -> tuple[int, int] | None:
        """The GPU's own total and free memory, bytes (the budget not applied); None on a CPU, which has no
        device memory to size pools from."""
        if not self.is_gpu:
            return None
        import torch

        free, total = torch.cuda.mem_get_info(self.device)
        return total, free

    def free_and_drawn(self) -> tuple[int, int]:
        if self.is_gpu:
            import torch

            total, free = self.total_and_free()
            if self.budget_nbytes:  # a budget below the device's memory: what is left of it
                free = min(free, self.budget_nbytes - (total - free))
            return free, torch.cuda.memory_reserved(self.device)
        if self.budget_nbytes:
            return self.budget_nbytes, 0
        return machine_memory_nbytes(), 0


def machine_memory_nbytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def checkpoint_weights_nbytes(model_dir: Path, dtype_size: int) -> int | None:
    """The weights a checkpoint dir will hold on the device, from its safetensors headers (no tensor read):
    floating tensors at the compute dtype's size, others (FP8 blocks, their scales) as stored."""
    try:
        from safetensors import safe_open
    except ImportError:
        return None
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        return None
    sizes = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4, "I16": 2,
             "I8": 1, "U8": 1, "BOOL": 1}
    total = 0
    for path in files:
        with safe_open(str(path), "np") as f:
            for name in f.keys():
                piece = f.get_slice(name)
                numel = 1
                for d in piece.get_shape():
                    numel *= d
                kind = piece.get_dtype()
                total += numel * (dtype_size if kind in ("F64", "F32", "F16", "BF16") else sizes.get(kind, 4))
    return total


class ResidencyPlanner:
    """The roles' book (core.Residency) and the one actor that loads and releases them."""

    def __init__(self, conductor: Any, memory: DeviceMemory, served: Claim, reader: RoleLoader | None = None,
                 narrator: bool = False, on_reader: Callable[[Any], None] | None = None,
                 served_memory: dict[str, Any] | None = None):
        """served: the served model's claim (it is loaded before the planner exists); reader: its loader, None
        for no reader; narrator: the profile's narrator is on (it decodes on the reader's weights and forks);
        on_reader(reader or None): told when the reader comes and goes (the service's view of its store);
        served_memory: how the served model's pools were sized at start (core.sizing's report), for the status."""
        self.conductor = conductor
        self.memory = memory
        self.served_memory = served_memory
        self.book = Residency()
        self.book.plan(served, RoleState.LOADED)
        self.reader_loader = reader
        self.narrator = narrator
        self.on_reader = on_reader
        self.reader: Any = None
        self.idle_load: asyncio.Task | None = None  # the first idle window's load, while it waits or runs
        self._lock = asyncio.Lock()  # one load or release at a time
        self.loads = 0
        if reader is None:
            self.book.off("reader")
            self.book.off("narrator")
        else:
            self.book.plan(reader.claim)
            if narrator:
                self.book.plan(Claim("narrator", reader.claim.model, reader.claim.weights_nbytes))
            else:
                self.book.off("narrator")

    # ---- lifecycle ---------------------------------------------------------------------------
    def start_when_idle(self, poll_s: float) -> None:
        """Load the reader in the first idle window after now (the server already answers)."""
        if self.reader_loader is not None and self.idle_load is None:
            self.idle_load = asyncio.get_running_loop().create_task(self._load_when_idle(poll_s), name="qse-planner")

    async def _load_when_idle(self, poll_s: float) -> None:
        board = self.conductor.board
        try:
            while not board.is_quiet() or self.conductor.num_waiting:
                await asyncio.sleep(poll_s)
            await self.load_reader()
        except ResidencyError as exc:
            log.error("role_not_loaded", role="reader", error=str(exc))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a failed load must never take the server down: it serves without the reader
            log.exception("role_load_failed", role="reader", error=repr(exc))
        finally:
            self.idle_load = None

    async def stop(self) -> None:
        if self.idle_load is not None:
            self.idle_load.cancel()
            await asyncio.gather(self.idle_load, return_exceptions=True)

    # ---- the verbs ---------------------------------------------------------------------------
    def admit(self, role: str) -> Verdict:
        free, drawn = self.memory.free_and_drawn()
        return self.book.admit(role, free, drawn, self.memory.where)

    async def load_reader(self) -> Verdict:
        """Admit the reader's claim and load it; ResidencyError when it does not fit (REFUSED, named) or is
        loaded already. Weights load under a hold and the box lock (turns keep running); the graphs and the
        attach under the engine lock too, behind every served request."""
        loader = self.reader_loader
        if loader is None:
            raise ResidencyError("this server has no reader (QSE_SHADOW_MODEL is empty or the profile's shadow is "
                                 "off)", "shadow_off")
        async with self._lock:
            if self.book.state("reader") is RoleState.LOADED:
                raise ResidencyError("the reader is loaded already", "already_loaded")
            board = self.conductor.board
            held = HeldLocks()
            async with board.hold(held):
                async with board.box_lock(held):
                    verdict = self.admit("reader")
                    if not verdict.fits:
                        log.warning("role_refused", role="reader", reason=verdict.message)
                        raise ResidencyError(verdict.message, "insufficient_memory")
                    self.book.set_state("reader", RoleState.LOADING)
                    log.info("role_loading", role="reader", verdict=verdict.message)
                    try:
                        reader = await asyncio.to_thread(loader.build)
                    except BaseException as exc:
                        self.book.set_state("reader", RoleState.FAILED, repr(exc))
                        raise
                async with board.engine_lock(Priority.NARRATOR, held):
                    async with board.box_lock(held):
                        try:
                            await asyncio.to_thread(loader.warm, reader)
                            self.conductor.attach_reader(reader)
                        except BaseException as exc:
                            self.book.set_state("reader", RoleState.FAILED, repr(exc))
                            raise
            self._loaded(reader, verdict)
            return verdict

    def load_reader_now(self) -> Verdict:
        """Load the reader before the server answers (QSE_SHADOW_LOAD=start): nothing runs yet, so there is no
        lock to take. ResidencyError when its claim does not fit."""
        loader = self.reader_loader
        if loader is None:
            raise ResidencyError("this server has no reader", "shadow_off")
        verdict = self.admit("reader")
        if not verdict.fits:
            raise ResidencyError(verdict.message, "insufficient_memory")
        self.book.set_state("reader", RoleState.LOADING)
        reader = loader.build()
        loader.warm(reader)
        self.conductor.attach_reader(reader)
        self._loaded(reader, verdict)
        return verdict

    def _loaded(self, reader: Any, verdict: Verdict) -> None:
        self.reader = reader
        weights = self.reader_loader.weights_nbytes(reader)
        if verdict.shares_weights_with is None:
            self.book.measured("reader", weights)
        self.book.set_state("reader", RoleState.LOADED)
        if self.narrator:
            self.book.set_state("narrator", RoleState.LOADED)
            self.book.roles["narrator"].verdict = Verdict(
                "narrator", True, 0, verdict.available_nbytes, "reader",
                "the narrator decodes on the reader's weights and forks: it claims nothing of its own")
        self.loads += 1
        if self.on_reader is not None:
            self.on_reader(reader)
        log.info("role_loaded", role="reader", shares_weights_with=verdict.shares_weights_with, weights=gib(weights))

    async def release_reader(self) -> dict[str, Any]:
        """Release the reader: its sessions parked (disk tier) or dropped, its pools freed, its weights too
        unless another role reads them. It can be loaded again (load_reader)."""
        async with self._lock:
            if self.book.state("reader") is not RoleState.LOADED:
                raise ResidencyError(f"the reader is not loaded (it is {self.book.state('reader').value})",
                                     "not_loaded")
            board = self.conductor.board
            held = HeldLocks()
            async with board.engine_lock(Priority.NARRATOR, held):
                async with board.box_lock(held):
                    reader = await self.conductor.detach_reader()
            if reader is not None:  # its files are written with the engine serving again (nothing else owns them now)
                await asyncio.to_thread(reader.residency.flush, reader)
            parked = reader.residency.stats().get("parked_sessions", 0) if reader is not None else 0
            self.reader = None
            if self.on_reader is not None:
                self.on_reader(None)
            del reader
            self.book.set_state("reader", RoleState.RELEASED)
            if self.narrator:
                self.book.set_state("narrator", RoleState.RELEASED)
            await asyncio.to_thread(_free_device_memory, self.memory.device)
            log.info("role_released", role="reader", parked_sessions=parked)
            return {"role": "reader", "state": RoleState.RELEASED.value, "parked_sessions": parked}

    # ---- status ------------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        free, drawn = self.memory.free_and_drawn()
        out = {"device": self.memory.where, "free_bytes": free, "drawn_bytes": drawn,
               "budget_bytes": self.memory.budget_nbytes or None, "roles": self.book.view()}
        if self.served_memory is not None:
            out["served_memory"] = self.served_memory
        return out


def _free_device_memory(device: Any) -> None:
    """What the released role held goes back to the device (not only to torch's cache)."""
    gc.collect()
    if getattr(device, "type", "") == "cuda":
        import torch

        torch.cuda.empty_cache()


__all__ = ["DeviceMemory", "GIB", "ResidencyError", "ResidencyPlanner", "RoleLoader", "checkpoint_weights_nbytes"]
