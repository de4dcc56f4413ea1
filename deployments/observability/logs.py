"""Logging setup for replicas: the engine library's records through Serve's logger, and no
traceback for a refusal the routes answer."""

import logging

from engine.request.invalid_request import InvalidRequestError
from engine.request.outputs import EngineOverloadedError


def route_logs_to_serve(name: str) -> None:
    """Send a library logger's records through this replica's Serve logger (its file, the
    driver's console), like the replica's own logs; without this INFO records are lost."""
    serve_logger = logging.getLogger("ray.serve")
    logger = logging.getLogger(name)
    logger.handlers = list(serve_logger.handlers)
    logger.setLevel(logging.INFO)
    logger.propagate = False


# Refusals the routes answer as a 429 or a 400: answers, not failures.
_ANSWERED = (EngineOverloadedError, InvalidRequestError)


class _AnsweredRefusals(logging.Filter):
    """Drops Serve's "Request failed." record for an _ANSWERED refusal: Serve logs every
    exception a replica's method raises at ERROR with its traceback, and under overload the
    engine refuses dozens of requests a second, each one's traceback taking the CPU the
    engine steps need."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], _ANSWERED))


def quiet_answered_refusals() -> None:
    """No traceback in this replica's log for a request the routes answer as a 429 or 400."""
    logging.getLogger("ray.serve").addFilter(_AnsweredRefusals())
