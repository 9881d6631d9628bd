"""What the calls leave in Redis, and the modules that keep it: a capability's copies (its
route and contract, read on every call), the counters the stats flush moves to the database,
the breaker and recent failures, call records, the degraded cache, and the pager's books.

Each module owns its Redis state (its encodings, its Lua, its rules over the values); the
keys themselves are named in sigil/redis_keys.py. The package sits below the services and
the engine, which call it, and above the models and runtimes; it imports neither services,
the engine, the tasks nor any entry point (pyproject.toml's import contracts).
"""
