"""A plain script as the loader host runs it: the bundle file it reads, and its start check.

Each plain script runs as a Dynamic Worker of the loader host (`capabilities/runtimes/host/
host.js`, in a workerd process of `capabilities.workerd`). The host reads `{sha}.json` from
the code directory: `mainModule`, `modules`, `compatibilityDate`, `env` (the plain_text
values) and `sealed`, the secret_text values, encrypted with AES-256-GCM under a key derived
(HKDF-SHA256, info "sigil bundle secrets") from the host's own secret, with the sha as
associated data. The emulator writes that format itself, from the upload Cloudflare was
given: it shares no code with the runtimes that place Sigil's own bundles, so a mistake of
theirs about Cloudflare cannot hide in the witness.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import hmac
import json
import os
from pathlib import Path
from typing import Any

import urllib3
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from cfemulator.uploads import ScriptUpload
from sigil.files import write_atomically

# The HKDF info host.js derives its unsealing key with.
_SEAL_INFO = b"sigil bundle secrets"
# The loader host's control headers: its secret, the code to run, and "start it, call nothing".
SECRET_HEADER = "X-Sigil-Secret"
LOADER_ID_HEADER = "X-Sigil-Loader-Id"
_START_CHECK_HEADER = "X-Sigil-Validate"
# Used by the server's request threads at once: a pool per host as wide as they come, so a
# busy emulator keeps its connections instead of opening (and warning about) a new one each time.
_ASK = urllib3.PoolManager(timeout=urllib3.Timeout(connect=5.0, read=30.0), retries=False, maxsize=32)


class HostUnanswered(Exception):
    """The loader host could not be asked, or gave no answer of its own."""


def _packed(value: Any) -> bytes:
    # The bundle's one serialisation: its sha is taken over exactly these bytes' shape.
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


def write_bundle(code_dir: Path, upload: ScriptUpload, *, host_secret: str) -> str:
    """Write the loader host's bundle of `upload` into `code_dir`, once per sha; return the sha.

    The sha covers the modules, the date, the plain values and, for each secret, a digest
    keyed with `host_secret` (never the value): a change of any gives a new loader id, so a
    fresh isolate. Idempotent.
    """
    plain = {b.name: b.value for b in upload.text_bindings if not b.secret}
    hidden = {b.name: b.value for b in upload.text_bindings if b.secret}
    stored: dict[str, Any] = {
        "mainModule": upload.main_module,
        "modules": upload.loader_modules,
        "compatibilityDate": upload.compatibility_date,
        "env": plain,
    }
    identity = dict(stored)
    if hidden:
        key = host_secret.encode()
        identity["secrets"] = {name: hmac.new(key, v.encode(), "sha256").hexdigest() for name, v in hidden.items()}
    sha = hashlib.sha256(_packed(identity)).hexdigest()
    path = Path(code_dir) / f"{sha}.json"
    if not path.exists():
        if hidden:
            stored["sealed"] = _sealed(hidden, host_secret=host_secret, sha=sha)
        write_atomically(path, _packed(stored))
    return sha


def _sealed(values: dict[str, str], *, host_secret: str, sha: str) -> str:
    key = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=_SEAL_INFO).derive(host_secret.encode())
    nonce = os.urandom(12)
    return base64.b64encode(nonce + AESGCM(key).encrypt(nonce, _packed(values), sha.encode())).decode()


def start_problem(*, port: int, host_secret: str, loader_id: str) -> str | None:
    """Have the loader host on 127.0.0.1:`port` start the code of `loader_id` without calling
    any handler: None when it starts, else workerd's words for why not (a syntax error, a
    throw at the top level).

    Raises FileNotFoundError when the host has no bundle for it, HostUnanswered when the host
    cannot be asked or cannot tell.
    """
    headers = {SECRET_HEADER: host_secret, LOADER_ID_HEADER: loader_id, _START_CHECK_HEADER: "1"}
    try:
        answer = _ASK.request("POST", f"http://127.0.0.1:{port}/", headers=headers)
    except urllib3.exceptions.HTTPError as exc:
        raise HostUnanswered(f"the loader host could not be asked to start the code: {exc}") from exc
    mark = answer.headers.get("x-sigil-error")
    if answer.status == 204:
        return None
    if (answer.status, mark) == (400, "invalid-code"):
        return _said(answer.data)
    if (answer.status, mark) == (404, "missing-code"):
        raise FileNotFoundError(loader_id)
    raise HostUnanswered(f"the loader host answered the start check with {answer.status} ({mark or 'unmarked'})")


def _said(body: bytes) -> str:
    """What the host's refusal says: its JSON `message`, else its text."""
    said = body.decode(errors="replace")
    with contextlib.suppress(ValueError, KeyError, TypeError):
        said = str(json.loads(said)["message"])
    return said.strip()
