"""The OpenAI error shape: ``{"error": {"message", "type", "param", "code"}}`` with a status.

Every refusal the API makes is an ``ApiError``; the app turns it into a response (or, once a
stream has started, into an error event). Messages say what was wrong and what to do.
"""

from __future__ import annotations

from typing import Any

#: The OpenAI ``type`` for each status the API answers with.
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    431: "invalid_request_error",
    500: "server_error",
    503: "service_unavailable",
}


class ApiError(Exception):
    """A request the API refuses: HTTP ``status``, a one-line ``message``, the offending
    ``param`` (None when it is not one parameter), a machine-readable ``code`` and extra
    response ``headers`` (``Retry-After`` on 429 and 503)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: tuple[tuple[str, str], ...] = (),
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        """The JSON body OpenAI clients parse (``openai.APIStatusError.body``)."""
        return error_body(self.status, self.message, param=self.param, code=self.code)


def error_body(
    status: int, message: str, *, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """``{"error": {...}}`` for ``status``."""
    kind = _TYPES.get(status, "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def bad_param(param: str, message: str, *, code: str = "invalid_value") -> ApiError:
    """A 400 naming the parameter ``param``."""
    return ApiError(400, f"{param}: {message}", param=param, code=code)
