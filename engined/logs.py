"""structlog set-up: JSON lines for machines, readable lines for people at a terminal.

A neutral module: the daemon, the tools and the Dynamo worker configure logging here, and it
imports no other `engined` module (tests/test_architecture.py).
"""

from __future__ import annotations

import logging
import sys

import structlog


def configure_logging(log_format: str, level: str) -> None:
    """`auto` means JSON unless stderr is a terminal (journald and log shippers get JSON)."""
    use_json = log_format == "json" or (log_format == "auto" and not sys.stderr.isatty())
    renderer: structlog.types.Processor = (
        structlog.processors.JSONRenderer() if use_json else structlog.dev.ConsoleRenderer()
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelNamesMapping()[level.upper()]
        ),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
