"""A Workers KV namespace of Sigil's on the account, known by its title (the loader runtime's
code, the Tail Worker's spool of call records, the edge's state): found or created once, its id
kept with the account's other facts (`facts.AccountFacts`) for every process, so that no
process lists the account's namespaces to find it again, and a route needs no API request."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from capabilities.runtimes.cloudflare.client import CloudflareClient, KvPair
from capabilities.runtimes.cloudflare.errors import CloudflareNotFound, CloudflareRejected
from capabilities.runtimes.cloudflare.facts import AccountFacts, kv_namespace_fact


class NamedKv:
    """The KV namespace titled `title`. Thread-safe: its one state is the id in `facts`.

    `id` finds the namespace (creating it when the account has none of that title) the first
    time any process asks, and remembers it; a namespace found missing since (deleted behind
    Sigil's back) is forgotten by the call that met it, and found or created again by the next.
    """

    def __init__(self, *, client: CloudflareClient, title: str, facts: AccountFacts | None = None) -> None:
        self.client = client
        self.title = title
        self.facts = facts or AccountFacts(client)
        self._fact = kv_namespace_fact(title)

    @property
    def id(self) -> str:
        """The namespace's id, created if missing. No I/O once this process knows it, one Redis
        read once any process does. Raises CloudflareUnavailable, CloudflareRejected."""
        return self.facts.get(self._fact, lambda: kv_namespace_ensure(self.client, self.title))

    def provision(self) -> bool:
        """Find the namespace on the account, whatever is remembered, creating it when missing,
        and remember its id. Returns whether it was created. Idempotent."""
        found = kv_namespace_find(self.client, self.title)
        namespace_id = found or kv_namespace_ensure(self.client, self.title)
        self.facts.put(self._fact, namespace_id)
        return found is None

    def forget(self) -> None:
        """Forget the id, for every process: the next `id` finds the namespace again."""
        self.facts.forget(self._fact)

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
