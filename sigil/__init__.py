"""Sigil's ground: what every app imports and that imports no app (errors, the Redis client,
request ids, encryption, logging, charts, leases, the owner-command base, process lifetime,
the restart rule of every supervisor, ports on 127.0.0.1, files replaced in one step, the
task policy and the jobs sent by name, values built from settings)."""
