"""What a route needs to know of the Cloudflare account (its workers.dev subdomain, the ids of
Sigil's KV namespaces), kept in Redis for every process.

Read from there first; asked of the API only when no process has asked yet, then shared; asked
again only once Cloudflare has said the kept one is wrong (`forget`). So a warm call, and a
process started while the API budget is spent, learn where a capability answers without an API
request: what a route needs must never wait on the budget.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import redis

from capabilities.runtimes.cloudflare.client import CloudflareClient
from sigil import redis_keys

logger = logging.getLogger(__name__)

SUBDOMAIN = "subdomain"


def kv_namespace_fact(title: str) -> str:
    return f"kv:{title}"


class AccountFacts:
    """One account's facts, for one process: each read from this process's memory, else from
    Redis, else asked of the API (through `ask`, and then written to Redis for the others).
    Thread-safe. Raises what the API call raises when a fact must be asked."""

    def __init__(self, client: CloudflareClient) -> None:
        self.client = client
        self.key = redis_keys.cf_facts(client.account_id)
        self._known: dict[str, str] = {}
        self._lock = threading.Lock()

    def subdomain(self) -> str:
        """The account's workers.dev subdomain (`<script>.<this>.workers.dev`). Raises
        CloudflareNotFound when the account has none, and the client's errors when it must ask."""
        return self.get(SUBDOMAIN, self.client.subdomain_get)

    def get(self, name: str, ask: Callable[[], str]) -> str:
        """The fact `name`: kept, else `ask()`ed once and kept for every process."""
        known = self._known.get(name)
        if known is not None:
            return known
        with self._lock:
            known = self._known.get(name)
            if known is not None:
                return known
            try:
                kept = self.client.redis.hget(self.key, name)
            except redis.RedisError as exc:
                # The API still knows it: a Redis out of reach costs a request, not the call.
                logger.warning("could not read the Cloudflare account's %s from Redis: %s", name, exc)
                kept = None
            if kept is not None:
                value = kept.decode()
            else:
                value = ask()
                try:
                    self.client.redis.hset(self.key, name, value)
                except redis.RedisError as exc:
                    logger.warning("could not keep the Cloudflare account's %s in Redis: %s", name, exc)
            self._known[name] = value
            return value

    def put(self, name: str, value: str) -> None:
        """Keep `value` as the fact `name`, for every process (it was just learnt). Idempotent."""
        with self._lock:
            self._known[name] = value
            try:
                self.client.redis.hset(self.key, name, value)
            except redis.RedisError as exc:
                logger.warning("could not keep the Cloudflare account's %s in Redis: %s", name, exc)

    def forget(self, name: str) -> None:
        """Cloudflare said the kept `name` is wrong: every process asks the API again on its next
        use (this one at once; the others once they read it from Redis again, in a new process
        or after forgetting it themselves). Idempotent."""
        with self._lock:
            self._known.pop(name, None)
            try:
                self.client.redis.hdel(self.key, name)
            except redis.RedisError as exc:
                logger.warning("could not forget the Cloudflare account's %s in Redis: %s", name, exc)
