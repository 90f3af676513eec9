"""Pure policy: the GPU-time ledger and the reader's scheduling decisions.

No torch, no asyncio, no wall clock: every decision takes `now` as an argument and returns a value,
so the runtime drives it in real time and the replay drives it on a virtual clock.
"""

from qse.core.chunk_cost import ChunkCostEstimator
from qse.core.drive import (ChunkDecision, ChunkPipe, DriveResult, PlanDriver, ReadEach, SpendDecision,
                            Stop)
from qse.core.idle import IdleBurst, IdleWindow, SessionBacklog, pick_idle_session
from qse.core.ledger import Balance, GpuLedger, Role, ms_to_us
from qse.core.locks import (EngineLockQueue, HeldLocks, LockRank, LockTable, Priority, find_deadlock,
                            may_acquire)
from qse.core.plan import ROLE_OF_WINDOW, Backlog, ReaderPlan, Window, next_backlog, plan_read, whole_chunks
from qse.core.ration import RationSlice, TurnRation
from qse.core.rounds import RoundPlan, RoundPlanner
from qse.core.scheduler import Scheduler
from qse.core.share import ShareBudget, s_to_us

__all__ = [
    "Backlog", "Balance", "ChunkCostEstimator", "ChunkDecision", "ChunkPipe", "DriveResult", "EngineLockQueue",
    "GpuLedger", "HeldLocks", "IdleBurst", "IdleWindow", "LockRank", "LockTable", "PlanDriver", "Priority",
    "ROLE_OF_WINDOW", "RationSlice", "ReadEach", "ReaderPlan", "Role", "RoundPlan", "RoundPlanner", "Scheduler", "SessionBacklog", "ShareBudget",
    "SpendDecision", "Stop", "TurnRation", "Window", "find_deadlock", "may_acquire", "ms_to_us", "next_backlog",
    "pick_idle_session", "plan_read", "s_to_us", "whole_chunks",
]
