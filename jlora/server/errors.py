"""`ApiError`: an error answered to the client as OpenAI's error body."""

from __future__ import annotations

from starlette.responses import JSONResponse

__all__ = ["ApiError"]


class ApiError(Exception):
    """An error answered to the client: HTTP status, message, OpenAI error type and the offending param."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.headers = status, message, param, kind, headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)
