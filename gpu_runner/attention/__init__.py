"""Attention over the paged KV cache: metadata and backends."""
