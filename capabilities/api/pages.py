"""Lists answered a page at a time (`limit`, `offset`), as the seeds' list shape has them:
`count`, `next`, `previous`, `results`."""

from __future__ import annotations

from collections.abc import Callable

from drf_spectacular.utils import OpenApiParameter
from rest_framework.pagination import LimitOffsetPagination
from rest_framework.response import Response
from rest_framework.views import APIView

PAGE_PARAMETERS = [OpenApiParameter("limit", int), OpenApiParameter("offset", int)]


class CapabilityPagination(LimitOffsetPagination):
    default_limit = 50
    max_limit = 200


class PagedApi(APIView):
    """A view whose GET answers a list a page at a time."""

    pagination_class = CapabilityPagination  # so that the schema shows the page's shape

    def answer_page(self, query, serialize: Callable[[list], list]) -> Response:
        """The page of `query` the request asks for, its items as `serialize` writes them."""
        paginator = self.pagination_class()
        page = paginator.paginate_queryset(query, self.request, view=self)
        return paginator.get_paginated_response(serialize(list(page)))
