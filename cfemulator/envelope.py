"""Cloudflare's JSON envelope and the error every emulated endpoint raises to produce one."""

from __future__ import annotations

import json
from typing import Any

# Messages follow the reference where it quotes them; the rest are the spec's
# `x-cfLinkErrors` descriptions (reference §7.1).
MESSAGES = {
    971: "Please wait and consider throttling your request speed",
    7003: "No route for the URI",
    10000: "Authentication error",
    10001: "Unsupported or unexpected Content Type",
    10002: "Unexpected internal server error",
    10006: "Unparseable script body",
    10007: "This Worker does not exist on your account.",
    10009: "get: 'key not found'",
    10013: "namespace not found",
    10016: "Invalid Worker name",
    10021: "Script content failed validation checks, but was otherwise parseable",
    10026: "The request body could not be parsed",
    10027: "Script body was too large",
}


class ApiError(Exception):
    """An API failure: rendered as the envelope with `code`, at HTTP `status`."""

    def __init__(self, status: int, code: int, message: str | None = None) -> None:
        self.status = status
        self.code = code
        self.message = message or MESSAGES.get(code, "error")
        super().__init__(f"{code}: {self.message}")


def success(result: Any, **extra: Any) -> bytes:
    return _dump({"success": True, "errors": [], "messages": [], "result": result, **extra})


def failure(code: int, message: str) -> bytes:
    return _dump({"success": False, "errors": [{"code": code, "message": message}], "messages": [], "result": None})


def _dump(body: dict[str, Any]) -> bytes:
    return json.dumps(body, separators=(",", ":")).encode()
