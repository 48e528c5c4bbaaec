"""Logging set-up shared by the services: one line per record, service name first."""

from __future__ import annotations

import logging
import os


def setup_logging(service: str, level: str | None = None) -> logging.Logger:
    """Configures the root logger once and returns the service's logger.

    The level comes from `level`, else `PAGEWIRE_LOG_LEVEL`, else INFO.
    """
    chosen = (level or os.environ.get("PAGEWIRE_LOG_LEVEL") or "INFO").upper()
    logging.basicConfig(
        level=chosen,
        format=f"%(asctime)s {service} %(levelname)s %(name)s: %(message)s",
    )
    return logging.getLogger(service)
