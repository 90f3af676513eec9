"""core's GPU-time ledger, safe to charge on an executor thread while the event loop reads it."""

from __future__ import annotations

import threading

from ..core.ledger import Balance, GpuLedger, Role


class RuntimeLedger(GpuLedger):
    """GpuLedger behind a lock: the read loop charges chunks on the engine's thread, status() reads on the loop."""

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.RLock()

    def open_turn(self, turn_id: str) -> bool:
        with self._lock:
            return super().open_turn(turn_id)

    def close_turn(self, turn_id: str) -> Balance | None:
        with self._lock:
            return super().close_turn(turn_id)

    def is_open(self, turn_id: str) -> bool:
        with self._lock:
            return super().is_open(turn_id)

    @property
    def num_open_turns(self) -> int:
        with self._lock:
            return len(self._turns)

    def record(self, role: Role, gpu_ms: float, *, turn_id: str | None = None,
               est_ms: float | None = None) -> int | None:
        with self._lock:
            return super().record(role, gpu_ms, turn_id=turn_id, est_ms=est_ms)

    def spent_us(self, role: Role, turn_id: str | None = None) -> int | None:
        with self._lock:
            return super().spent_us(role, turn_id)

    def balance(self, turn_id: str | None = None) -> Balance | None:
        with self._lock:
            return super().balance(turn_id)

    @property
    def total_ms(self) -> dict[str, float]:
        """Every role's total in ms, by role name (what /metrics and status() show)."""
        total = self.balance()
        assert total is not None
        return {role.value: total.gpu_us.get(role, 0) / 1000 for role in Role}

    @property
    def entries(self) -> int:
        total = self.balance()
        assert total is not None
        return sum(total.num_entries.values())
