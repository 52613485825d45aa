"""OpenAI-style error bodies (`{"error": {message, type, param, code}}`) and their statuses."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from cluster.generation import GenerationError
from cluster.protocol_base import INVALID_TEXT, UNSUPPORTED

RETRY_AFTER_S = 1  # what a 429 asks the client to wait


class APIError(Exception):
    """An error a client caused or should know about, rendered as an OpenAI error body."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        type_: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type_ or ("invalid_request_error" if status < 500 else "server_error")
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return AsciiJSONResponse(self.body(), status_code=self.status, headers=self.headers)


class AsciiJSONResponse(JSONResponse):
    """JSON with non-ASCII escaped: an error may echo text that is not valid Unicode (a lone
    surrogate in ``model``), which UTF-8 cannot encode but a ``\\ud800`` escape can carry."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode("ascii")


def generation_error(e: GenerationError) -> APIError:
    """The error a client sees for a failed generation (overload: 429 with Retry-After)."""
    if e.status == 429:
        return APIError(
            429,
            str(e),
            code="server_overloaded",
            type_="rate_limit_error",
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )
    if e.status == 504:
        return APIError(504, str(e), code="request_timeout")
    return APIError(e.status, str(e), code="service_unavailable")


def _param(loc: Sequence[Any]) -> str | None:
    """The dotted field path of a pydantic error location, without pydantic's union-branch
    tags ("str", "list[int]", and the tag after a tagged union's index)."""
    parts: list[str] = []
    tag_next = False
    for p in (str(x) for x in loc if x != "body"):
        if "tagged-union[" in p:
            tag_next = True
        elif tag_next and not p.isdigit():
            tag_next = False
        elif not (p.startswith(("list[", "function-")) or p in ("str", "int")):
            parts.append(p)
    return ".".join(parts) or None


def _rank(error: dict[str, Any]) -> tuple[int, int]:
    """Which of several errors to report: a refusal or an unknown field first (they say what to
    change), then the deepest location (the union branch that matched the input's shape)."""
    kind = error.get("type")
    return (kind in (UNSUPPORTED, "extra_forbidden"), len(error.get("loc", ())))


def validation_error(exc: RequestValidationError) -> APIError:
    errors = [dict(e) for e in exc.errors()]
    first: dict[str, Any] = (
        max(errors, key=_rank) if errors else {"loc": (), "msg": "invalid request"}
    )
    kind = first.get("type")
    if kind == "json_invalid":
        ctx: dict[str, Any] = first.get("ctx") or {}
        detail = ctx.get("error", first.get("msg"))
        return APIError(400, f"request body is not valid JSON: {detail}", code="invalid_json")
    if kind == INVALID_TEXT:
        path = str((first.get("ctx") or {}).get("path") or "") or None
        return APIError(400, str(first.get("msg")), param=path, code="invalid_value")
    param = _param(first.get("loc", ()))
    msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    if kind == "missing":
        return APIError(400, f"'{param}' is a required property", param=param, code="missing_field")
    if kind == UNSUPPORTED:
        text = msg if param and f"'{param}'" in msg else f"{msg} (at '{param}')"
        return APIError(400, text, param=param, code="unsupported_parameter")
    if kind == "extra_forbidden":
        return APIError(
            400,
            f"unrecognised field '{param}': this server takes the fields listed in docs/api.md",
            param=param,
            code="unknown_parameter",
        )
    return APIError(400, f"invalid value for '{param}': {msg}", param=param, code="invalid_value")


def install_error_handlers(app: FastAPI) -> None:
    """Render every error the app can raise as an OpenAI error body."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = "not_found" if exc.status_code == 404 else None
        return APIError(exc.status_code, str(exc.detail), code=code).response()
