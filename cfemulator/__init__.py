"""A local Cloudflare API emulator: the subset of the REST API Sigil uses, with real workerd behind it."""
