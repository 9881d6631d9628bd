"""A Workers KV namespace of Sigil's on the account, known by its title (the loader runtime's
code, the Tail Worker's call records, the edge's state): found or created once, its id kept in
Redis for every process, so that no process lists the account's namespaces to find it again."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from capabilities.runtimes.cloudflare.client import CloudflareClient, KvPair
from capabilities.runtimes.cloudflare.errors import CloudflareNotFound, CloudflareRejected


class NamedKv:
    """The KV namespace titled `title`. Thread-safe: its one state is the id in Redis.

    `id` finds the namespace (creating it when the account has none of that title) the first
    time any process asks, and remembers it; a namespace found missing since (deleted behind
    Sigil's back) is forgotten by the call that met it, and found or created again by the next.
    """

    def __init__(self, *, client: CloudflareClient, title: str) -> None:
        self.client = client
        self.title = title
        self._key = f"sigil:cf:kv:{client.account_id}:{title}"

    @property
    def id(self) -> str:
        """The namespace's id, created if missing. One Redis read once known to any process.
        Raises CloudflareUnavailable, CloudflareRejected."""
        known = self.client.redis.get(self._key)
        if known is not None:
            return known.decode()
        return self._remember(kv_namespace_ensure(self.client, self.title))

    def provision(self) -> bool:
        """Find the namespace on the account, whatever is remembered, creating it when missing,
        and remember its id. Returns whether it was created. Idempotent."""
        found = kv_namespace_find(self.client, self.title)
        created = found is None
        self._remember(found or kv_namespace_ensure(self.client, self.title))
        return created

    def forget(self) -> None:
        """Forget the id, for every process: the next `id` finds the namespace again."""
        self.client.redis.delete(self._key)

    def _remember(self, namespace_id: str) -> str:
        self.client.redis.set(self._key, namespace_id)
        return namespace_id

    # --- calls that forget a namespace found missing ------------------------------------------

    def bulk_put(self, pairs: Sequence[KvPair]) -> list[str]:
        """CloudflareClient.kv_bulk_put on this namespace."""
        return self._forgetting_missing(self.client.kv_bulk_put, pairs)

    def bulk_delete(self, keys: Sequence[str]) -> list[str]:
        """CloudflareClient.kv_bulk_delete on this namespace."""
        return self._forgetting_missing(self.client.kv_bulk_delete, keys)

    def keys(self, *, prefix: str) -> list[dict[str, Any]]:
        """CloudflareClient.kv_keys on this namespace."""
        return self._forgetting_missing(lambda namespace_id: self.client.kv_keys(namespace_id, prefix=prefix))

    def _forgetting_missing(self, call, *args):
        try:
            return call(self.id, *args)
        except CloudflareNotFound:
            # Only a namespace is missing for these calls (none reads one key).
            self.forget()
            raise


def kv_namespace_ensure(client: CloudflareClient, title: str) -> str:
    """The id of the KV namespace titled `title`, created if missing."""
    found = kv_namespace_find(client, title)
    if found is not None:
        return found
    try:
        return str(client.kv_namespace_create(title)["id"])
    except CloudflareRejected:
        # A concurrent provision created it meanwhile (10014, a taken title): use that one.
        found = kv_namespace_find(client, title)
        if found is None:
            raise
        return found


def kv_namespace_find(client: CloudflareClient, title: str) -> str | None:
    for namespace in client.kv_namespace_list():
        if namespace.get("title") == title:
            return str(namespace["id"])
    return None
