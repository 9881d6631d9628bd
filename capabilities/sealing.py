"""How a code bundle's secrets are sealed for the loader host that opens them (host/host.js
derives the same key): AES-256-GCM under a key derived (HKDF-SHA256) from the host's own
secret, bound to the bundle's sha. Sealed by the runtimes when they store a bundle; opened
by the host, and by the local runtime's supervisor to mask them in what workerd prints."""

from __future__ import annotations

import base64
import json

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

# HKDF's `info` for the key that seals a bundle's secrets; host/host.js derives the same key.
SEAL_INFO = b"sigil bundle secrets"


def bundle_seal_key(host_secret: str) -> bytes:
    """The AES-256 key sealing bundles' secrets for the loader host that holds `host_secret`."""
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=SEAL_INFO).derive(host_secret.encode())


def bundle_secrets_unseal(stored: bytes, *, seal_key: str, sha: str) -> dict[str, str]:
    """The secrets a stored bundle (`CodeBundle.to_json`) of `sha` carries sealed for the host
    whose SIGIL_SECRET is `seal_key` ({} when it carries none). Raises ValueError when
    `stored` is no bundle or its secrets were sealed for another key or another sha."""
    try:
        sealed = json.loads(stored).get("sealed")
    except (ValueError, AttributeError) as exc:
        raise ValueError(f"not a stored bundle: {exc}") from exc
    if not sealed:
        return {}
    raw = base64.b64decode(sealed)
    try:
        opened = AESGCM(bundle_seal_key(seal_key)).decrypt(raw[:12], raw[12:], sha.encode())
    except InvalidTag as exc:
        raise ValueError("the bundle's secrets are sealed for another key or another sha") from exc
    return json.loads(opened)
