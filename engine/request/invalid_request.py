"""The error every broken request rule raises: a ValueError naming the request field at
fault (`param`), which the HTTP layer turns into a 400 naming it."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    def __init__(self, message: str, param: str = "prompt", code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code

    def __reduce__(self):  # keep param and code across Ray's pickling
        return (type(self), (str(self), self.param, self.code))
