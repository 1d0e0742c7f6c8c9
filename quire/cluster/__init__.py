"""Multi-host placement on Ray: `quire cluster` (see placement.py). Ray is imported lazily, so
quire imports and serves without it."""
