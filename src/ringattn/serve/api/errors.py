"""A refused request: the HTTP status and the OpenAI API's error body (message, type, param,
code). Raised on rank 0, before anything reaches the other ranks."""

from __future__ import annotations

__all__ = ["APIError"]


class APIError(Exception):
    """A refused request: HTTP `status` with the API's error body."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None,
                 status: int = 400, kind: str = "invalid_request_error"):  # fmt: skip
        super().__init__(message)
        self.message, self.param, self.code, self.status, self.kind = (
            message, param, code, status, kind)  # fmt: skip

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}  # fmt: skip
