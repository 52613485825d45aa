"""tandem's loggers in a Serve replica write through its Serve log handlers, with their fields."""

from __future__ import annotations

import importlib
import logging
import logging.handlers

TANDEM_LOGGERS = (
    "cluster",
    "decode",
    "prefill",
    "serving",
    "kvtransfer",
    "speculation",
    "runtime",
    "models",
    "distill",
    "tandem",
    "nixl",
)
SERVE_LOGGER = "ray.serve"


def route_to_serve() -> None:
    """Give tandem's loggers the Serve logger's handlers and level (a no-op outside a replica)."""
    serve_logger = logging.getLogger(SERVE_LOGGER)
    if not serve_logger.handlers:
        return
    _import_nixl_keeping(serve_logger.handlers)
    for name in TANDEM_LOGGERS:
        logger = logging.getLogger(name)
        logger.handlers = list(serve_logger.handlers)
        logger.setLevel(serve_logger.level)
        logger.propagate = False


def _import_nixl_keeping(handlers: list[logging.Handler]) -> None:
    """Import NIXL, whose ``dictConfig`` closes every handler, and give each ``MemoryHandler``
    back the target it lost (else the replica's log stops; a file handler reopens by itself)."""
    targets = {h: h.target for h in handlers if isinstance(h, logging.handlers.MemoryHandler)}
    try:
        importlib.import_module("nixl")
    except ImportError:
        return
    for handler, target in targets.items():
        if handler.target is None:
            handler.setTarget(target)
