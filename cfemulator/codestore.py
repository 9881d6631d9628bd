"""An upload becoming a script of the account: the checks against the account, the bindings a
new upload keeps, and the bundles the loader host reads (`cfemulator.hostcode`)."""

from __future__ import annotations

import time
import uuid
from dataclasses import replace

from cfemulator.api_common import _now
from cfemulator.bound import needs_own_workerd
from cfemulator.compat import check_compatibility
from cfemulator.envelope import ApiError
from cfemulator.hostcode import write_bundle
from cfemulator.state import Script
from cfemulator.uploads import ScriptUpload


class CodeStore:
    """The code store of `CloudflareApi` (a mixin: the account's state and config are the API's)."""

    def _upload_stored(
        self, name: str, upload: ScriptUpload, existing: Script | None, *, propagates: bool = True
    ) -> Script:
        """What an upload of `name` (over `existing`, if any) makes of the script, as Cloudflare
        checks it: its kept bindings added, their targets found in the account, its code
        started. A new script is served once propagated, unless not `propagates` (at once).

        Raises ApiError with Cloudflare's code for the first check it fails.
        """
        upload = self._checked(name, upload, existing)
        return self._store(name, upload, existing, propagates=propagates)

    def _checked(self, name: str, upload: ScriptUpload, existing: Script | None) -> ScriptUpload:
        """`upload` with its kept bindings, once it passes Cloudflare's checks against the
        account (compatibility, binding targets, a start). Raises ApiError otherwise."""
        check_compatibility(upload.compatibility_date, upload.compatibility_flags, self._runtime)
        upload = self._kept_bindings(upload, existing)
        self._check_binding_targets(upload)
        self._check_start(name, upload)
        return upload

    def _check_binding_targets(self, upload: ScriptUpload) -> None:
        """A KV binding must name a KV namespace of the account (10042), a dispatch namespace
        binding a dispatch namespace (10021), and a Worker Loader needs the Paid plan (10021,
        with the text a free account gets)."""
        for binding in upload.bindings:
            kind = binding["type"]
            if kind == "worker_loader" and self._config.plan != "paid":
                raise ApiError(400, 10021, f"binding {binding['name']} of type {kind} is invalid")
            if kind == "kv_namespace" and binding["namespace_id"] not in self.kv_namespaces:
                raise ApiError(400, 10042, f"KV namespace '{binding['namespace_id']}' is not valid.")
            if kind == "dispatch_namespace" and binding["namespace"] not in self.namespaces:
                raise ApiError(
                    400, 10021, f"binding {binding['name']} of type {kind} is invalid: no such dispatch namespace"
                )

    def _check_start(self, name: str, upload: ScriptUpload) -> None:
        """Refuse code that does not start, as Cloudflare does at upload, after the cheaper
        checks. Scripts that run in a workerd of their own (cfemulator.bound) are started
        there on first use instead."""
        if self._start_check is None or needs_own_workerd(upload):
            return
        sha = self._write_bundle(upload)
        problem = self._start_check(f"{name}@{sha}")
        if problem is not None:
            self._release(sha)
            raise ApiError(400, 10021, problem)

    def _store(self, name: str, upload: ScriptUpload, existing: Script | None, *, propagates: bool) -> Script:
        """Write the bundle the loader host reads and return the script that serves it.

        The bundle's sha covers everything the script runs with (modules, date, text
        bindings), so a change of any of them gives a new loader id and a fresh isolate.
        """
        sha = self._write_bundle(upload)
        stamp = _now()
        deployment = str(uuid.uuid4())
        self._generation += 1
        if existing is None:
            live_at = time.time() + (self._config.propagation_delay if propagates else 0.0)
            return Script(
                name=name,
                sha=sha,
                upload=upload,
                created_on=stamp,
                modified_on=stamp,
                live_at=live_at,
                deployment_id=deployment,
                generation=self._generation,
            )
        old_sha = existing.sha
        existing.sha, existing.upload, existing.modified_on = sha, upload, stamp
        existing.deployment_id, existing.generation = deployment, self._generation
        if old_sha != sha:
            self._release(old_sha)
        return existing

    @staticmethod
    def _kept_bindings(upload: ScriptUpload, existing: Script | None) -> ScriptUpload:
        """`upload` with the previous upload's bindings of the types its `keep_bindings` names
        carried over, unless it binds that name itself (reference §1.2: Wrangler keeps
        `secret_text` and `secret_key` this way, so secrets set apart survive a deploy)."""
        if existing is None or not upload.keep_bindings:
            return upload
        named = {binding["name"] for binding in upload.bindings}
        kept = [
            binding
            for binding in existing.upload.bindings
            if binding["type"] in upload.keep_bindings and binding["name"] not in named
        ]
        if not kept:
            return upload
        kept_names = {binding["name"] for binding in kept}
        texts = tuple(b for b in existing.upload.text_bindings if b.name in kept_names)
        return replace(upload, bindings=[*upload.bindings, *kept], text_bindings=(*upload.text_bindings, *texts))

    def _write_bundle(self, upload: ScriptUpload) -> str:
        """Write the loader host's bundle for `upload`, once per sha; return the sha."""
        return write_bundle(self.code_dir, upload, host_secret=self._seal_key)

    def _release(self, sha: str) -> None:
        """Delete a bundle no script uses any more."""
        in_use = any(s.sha == sha for s in self.scripts.values()) or any(
            s.sha == sha for ns in self.namespaces.values() for s in ns.scripts.values()
        )
        if not in_use:
            (self.code_dir / f"{sha}.json").unlink(missing_ok=True)
