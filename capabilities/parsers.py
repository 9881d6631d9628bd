"""How the control API reads request bodies."""

from __future__ import annotations

import io

from django.conf import settings
from rest_framework.parsers import JSONParser

from sigil.errors import InvalidRequest, TooLarge


class LimitedJSONParser(JSONParser):
    """JSON with a size cap, read without trusting Content-Length (over the cap is a 413),
    and a nesting cap (deeper is a 400, never the parser's RecursionError)."""

    def parse(self, stream, media_type=None, parser_context=None):
        limit = settings.SIGIL_DEPLOY_MAX_BODY_BYTES
        raw = stream.read(limit + 1) if stream is not None else b""
        if len(raw) > limit:
            raise TooLarge(f"the request body is over {limit} bytes")
        max_depth = settings.SIGIL_JSON_MAX_DEPTH
        too_deep = InvalidRequest(f"the JSON body is nested deeper than {max_depth} levels")
        try:
            data = super().parse(io.BytesIO(raw), media_type, parser_context)
        except RecursionError:
            raise too_deep from None
        if json_depth_over(data, max_depth):
            raise too_deep
        return data


def json_depth_over(value, limit: int) -> bool:
    """Whether parsed JSON nests arrays and objects more than `limit` deep (no recursion)."""
    pending = [(value, 1)]
    while pending:
        item, depth = pending.pop()
        if isinstance(item, dict | list):
            if depth > limit:
                return True
            children = item.values() if isinstance(item, dict) else item
            pending.extend((child, depth + 1) for child in children if isinstance(child, dict | list))
    return False
