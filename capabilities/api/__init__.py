"""The control API (/_api/…): thin views that translate JSON, call one service, translate back.

`deploy` holds the writes, `discover` the reads, `operate` the owner's and the plain paths;
`serializers` the answers' shapes, `pages` the paged lists; `schema` what the OpenAPI
document adds (the error responses, from the catalogue in sigil/errors.py). What other entry points (MCP, the admin)
share with the API is re-exported here, so that both answer in one shape.
"""

from capabilities.api.deploy import deploy_answer
from capabilities.api.serializers import (
    CallRecordSerializer,
    CapabilityDetailSerializer,
    CapabilitySerializer,
    VersionSerializer,
    capability_url,
)

__all__ = [
    "CallRecordSerializer",
    "CapabilityDetailSerializer",
    "CapabilitySerializer",
    "VersionSerializer",
    "capability_url",
    "deploy_answer",
]
