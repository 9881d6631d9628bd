"""Secrets kept in the database (binding secrets, agents' webhook keys), encrypted with Fernet
under SIGIL_SECRETS_KEY, or a key derived from SECRET_KEY when that is empty."""

from __future__ import annotations

import base64
import hashlib

from cryptography.fernet import Fernet, InvalidToken
from django.conf import settings

from sigil.errors import InvalidRequest


def secrets_key() -> str:
    """The Fernet key the database's secrets are encrypted under. (The derivation's label
    dates from when only binding secrets were stored: changing it would orphan them.)"""
    return (
        settings.SIGIL_SECRETS_KEY
        or base64.urlsafe_b64encode(hashlib.sha256(f"sigil-bindings:{settings.SECRET_KEY}".encode()).digest()).decode()
    )


def secret_encrypt(plain: str) -> str:
    return Fernet(secrets_key()).encrypt(plain.encode()).decode()


def secret_decrypt(token: str) -> str:
    """Raises InvalidRequest when the secret was encrypted under another key."""
    try:
        return Fernet(secrets_key()).decrypt(token.encode()).decode()
    except InvalidToken as exc:
        raise InvalidRequest(
            "a secret stored in the database cannot be decrypted: SIGIL_SECRETS_KEY changed since it was stored"
        ) from exc
