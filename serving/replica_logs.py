"""tandem's loggers inside a Ray Serve replica write through the replica's Serve log handlers.

Serve configures only its own logger (``ray.serve``, which does not propagate) from the
deployment's ``logging_config``: its handlers write the replica's log file, as JSON when asked,
and stamp each record with the request id, deployment and replica of the request being served.
tandem's module loggers would otherwise reach Python's last-resort stderr handler (warnings
only, no fields). Pointing them at the same handlers gives every tandem line the same fields
as Serve's access lines, so one request can be followed across ingress, prefill and decode.

NIXL configures logging with ``logging.config.dictConfig`` when it is first imported, which
closes every handler in the process: Serve's buffering handler then drops its target and the
replica's log file stops at its first line (a decode or prefill replica logged nothing after
"Started initializing replica."). ``route_to_serve`` therefore imports NIXL first and gives
Serve's handlers their targets back, then routes NIXL's lines through them as well.
"""

from __future__ import annotations

import importlib
import logging
import logging.handlers

# the top-level packages whose module loggers (``logging.getLogger(__name__)``) are tandem's,
# and the CLI's logger
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
    """Give tandem's loggers the Serve logger's handlers and level (call in a replica's
    constructor, after Serve has configured its logger). Outside a replica Serve's logger has
    no handlers, and nothing changes."""
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
    """Import NIXL (its logging setup closes all handlers) and undo what that did to
    ``handlers``: a closed ``MemoryHandler`` has lost its target; a closed file handler
    reopens its file on the next record by itself."""
    targets = {h: h.target for h in handlers if isinstance(h, logging.handlers.MemoryHandler)}
    try:
        importlib.import_module("nixl")
    except ImportError:
        return  # no NIXL in this environment: nothing closed the handlers
    for handler, target in targets.items():
        if handler.target is None:
            handler.setTarget(target)
