"""kv layer."""
