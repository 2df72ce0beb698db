"""The KV-cache-aware router: global prefix index from events, probing, routing policies."""
