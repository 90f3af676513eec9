"""The usage ledger format, converters from public traces, and the replay simulator (qse/core on a virtual clock)."""

from qse.replay.read_model import ReadModel
from qse.replay.rounds import DecodeCost, simulate_rounds
from qse.replay.simulator import SimOptions, SimResult, Simulator, simulate
from qse.replay.traces import Converted, Rates, convert
from qse.replay.usage import UsageRecord, read_usage, write_usage

__all__ = ["Converted", "DecodeCost", "Rates", "ReadModel", "SimOptions", "SimResult", "Simulator", "UsageRecord", "convert",
           "read_usage", "simulate", "simulate_rounds", "write_usage"]
