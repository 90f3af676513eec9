"""Every log line a JSON object: structlog events (requests, turns, chunk reads, slices) and uvicorn's own.

One line a event on stderr, `{"event": ..., "level": ..., "timestamp": ..., ...}`, so decode loss
and the reader's share can be charted from the log alone.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog

_SHARED = [
    structlog.contextvars.merge_contextvars,
    structlog.processors.add_log_level,
    structlog.processors.TimeStamper(fmt="iso", utc=True),
]


def configure_logging(level: str = "info") -> None:
    number = logging.getLevelName(level.upper())
    if not isinstance(number, int):
        raise ValueError(f"log level {level!r} is not one of debug, info, warning, error, critical")
    structlog.configure(
        processors=[*_SHARED, structlog.processors.format_exc_info, structlog.processors.JSONRenderer()],
        wrapper_class=structlog.make_filtering_bound_logger(number),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=False,
    )


def uvicorn_log_config(level: str = "info") -> dict[str, Any]:
    """uvicorn's stdlib loggers through structlog's formatter: the same JSON lines."""
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {
            "json": {
                "()": structlog.stdlib.ProcessorFormatter,
                "processors": [structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                               structlog.processors.format_exc_info, structlog.processors.JSONRenderer()],
                "foreign_pre_chain": [*_SHARED, structlog.stdlib.add_logger_name],
            },
        },
        "handlers": {"default": {"class": "logging.StreamHandler", "formatter": "json", "stream": "ext://sys.stderr"}},
        "loggers": {
            "uvicorn": {"handlers": ["default"], "level": level.upper(), "propagate": False},
            "uvicorn.error": {"handlers": ["default"], "level": level.upper(), "propagate": False},
            "uvicorn.access": {"handlers": ["default"], "level": "WARNING", "propagate": False},
        },
    }
