"""Lists answered a page at a time (`limit`, `offset`), as the seeds' list shape has them:
`count`, `next`, `previous`, `results`."""

from __future__ import annotations

from collections.abc import Callable

from drf_spectacular.utils import OpenApiParameter
from rest_framework.pagination import LimitOffsetPagination
from rest_framework.response import Response
from rest_framework.views import APIView

from sigil.errors import InvalidRequest

DEFAULT_LIMIT, MAX_LIMIT = 50, 200

PAGE_PARAMETERS = [
    OpenApiParameter(
        "limit",
        {"type": "integer", "minimum": 1},
        description=f"At most this many items (default {DEFAULT_LIMIT}; more than {MAX_LIMIT} is {MAX_LIMIT}).",
    ),
    OpenApiParameter("offset", {"type": "integer", "minimum": 0}, description="Items to skip (default 0)."),
]


class CapabilityPagination(LimitOffsetPagination):
    """DRF's limit and offset, except that a value that is not a whole number in range is a
    400 naming it, where DRF would quietly answer the first page."""

    default_limit = DEFAULT_LIMIT
    max_limit = MAX_LIMIT

    def get_limit(self, request):
        return min(_whole(request, self.limit_query_param, least=1, default=self.default_limit), self.max_limit)

    def get_offset(self, request):
        return _whole(request, self.offset_query_param, least=0, default=0)


def _whole(request, name: str, *, least: int, default: int) -> int:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    if not raw.isascii() or not raw.isdigit() or int(raw) < least:
        raise InvalidRequest(f"{name} must be a whole number, at least {least}; got {raw!r}")
    return int(raw)


class PagedApi(APIView):
    """A view whose GET answers a list a page at a time."""

    pagination_class = CapabilityPagination  # so that the schema shows the page's shape

    def answer_page(self, query, serialize: Callable[[list], list]) -> Response:
        """The page of `query` the request asks for, its items as `serialize` writes them."""
        paginator = self.pagination_class()
        page = paginator.paginate_queryset(query, self.request, view=self)
        return paginator.get_paginated_response(serialize(list(page)))
