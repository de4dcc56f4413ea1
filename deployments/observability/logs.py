"""Logging setup for replicas: the engine library's records through Serve's logger."""

import logging


def route_logs_to_serve(name: str) -> None:
    """Send a library logger's records through this replica's Serve logger (its file, the
    driver's console), like the replica's own logs; without this INFO records are lost."""
    serve_logger = logging.getLogger("ray.serve")
    logger = logging.getLogger(name)
    logger.handlers = list(serve_logger.handlers)
    logger.setLevel(logging.INFO)
    logger.propagate = False
