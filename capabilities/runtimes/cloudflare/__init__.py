"""The one Cloudflare REST client: envelopes, error codes, retries, and the shared rate budget.

Every call to the Cloudflare API from any Sigil process goes through `CloudflareClient`. It
parses Cloudflare's `{"success", "errors", "messages", "result"}` envelope, maps Cloudflare's
error codes to the runtime error types (so runtimes raise only those), retries what is
transient with exponential backoff and jitter (honouring `Retry-After`), and draws every
request from one rate budget kept in Redis, shared by all processes of the deployment.

The API token is held only in the session's `Authorization` header. It is never logged, never
part of an exception message (messages echoed from the server are redacted too) and never in
a repr.

One module per concern: `errors` (Cloudflare's codes and the error types), `budget` (the rate
budget, served by class of work), `client` (the client), `uploads` (a script upload's parts),
`kv` (a Workers KV namespace of Sigil's, by its title), `account` (what the runtimes on an
account share), `facts` (what routes need to know of the account, kept in Redis). Callers
import from here.
"""

from capabilities.runtimes.cloudflare.budget import RateBudget
from capabilities.runtimes.cloudflare.client import (
    OPERATIONS,
    CloudflareClient,
    KvPair,
    ScriptInfo,
)
from capabilities.runtimes.cloudflare.errors import (
    CloudflareAuthFailure,
    CloudflareError,
    CloudflareNotFound,
    CloudflarePlanRequired,
    CloudflareRateLimited,
    CloudflareRejected,
    CloudflareScriptTooLarge,
    CloudflareSlotsExhausted,
    CloudflareUnavailable,
)
from capabilities.runtimes.cloudflare.kv import NamedKv
from capabilities.runtimes.cloudflare.uploads import metadata_binding, module_content_type, upload_parts

__all__ = [
    "OPERATIONS",
    "CloudflareAuthFailure",
    "CloudflareClient",
    "CloudflareError",
    "CloudflareNotFound",
    "CloudflarePlanRequired",
    "CloudflareRateLimited",
    "CloudflareRejected",
    "CloudflareScriptTooLarge",
    "CloudflareSlotsExhausted",
    "CloudflareUnavailable",
    "KvPair",
    "NamedKv",
    "RateBudget",
    "ScriptInfo",
    "metadata_binding",
    "module_content_type",
    "upload_parts",
]
