"""Logging for the framework's own loggers, leaving the root logger (and httpx, Ray) alone."""

from __future__ import annotations

import logging

OUR_LOGGERS = ("fedfm_flower", "strategies", "server_apps", "client_apps")


def configure_logging(level: int = logging.INFO) -> None:
    """Send our loggers' records to stderr once, with a short format; idempotent."""
    for name in OUR_LOGGERS:
        logger = logging.getLogger(name)
        logger.setLevel(level)
        if not any(getattr(h, "_fedfm", False) for h in logger.handlers):
            handler = logging.StreamHandler()
            handler._fedfm = True  # type: ignore[attr-defined]
            handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
            logger.addHandler(handler)
        logger.propagate = False
