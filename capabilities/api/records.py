"""The origin's endpoint for call records pushed by Sigil's Workers on Cloudflare
(`POST /_call-records`): no token, a signature instead (capabilities/record_pushes.py)."""

from __future__ import annotations

from django.conf import settings
from django.http import HttpResponse
from django.views.decorators.csrf import csrf_exempt

from capabilities import services
from capabilities.log_limits import LogLimits
from capabilities.record_pushes import PUSH_PATH, SIGNATURE_HEADER, SIGNED_AT_HEADER
from sigil import errors


@csrf_exempt
def call_records_push_view(request) -> HttpResponse:
    """Take one signed batch: `204` once it is kept (or was before), the envelope's `403` for a
    bad or stale signature, `400` for a body that is no batch, `413` past the batch bound."""
    if request.method != "POST":
        response = errors.error_response(errors.MethodNotAllowed(f"/{PUSH_PATH} answers POST"))
        response["Allow"] = "POST"
        return response
    limits = LogLimits.from_settings()
    try:
        length = int(request.META.get("CONTENT_LENGTH") or 0)
    except ValueError:
        length = -1
    if not 0 <= length <= limits.batch_bytes:
        return errors.error_response(
            errors.TooLarge(f"a batch of call records is at most {limits.batch_bytes} bytes; this one is {length}")
        )
    try:
        services.call_records_push(
            body=request.read(length),
            signed_at=request.headers.get(SIGNED_AT_HEADER, ""),
            signature=request.headers.get(SIGNATURE_HEADER, ""),
            secret=settings.SIGIL_INTERNAL_SECRET,
            backend=settings.SIGIL_BACKEND,
            limits=limits,
        )
    except (errors.Forbidden, errors.InvalidRequest) as exc:
        return errors.error_response(exc)
    return HttpResponse(status=204)
