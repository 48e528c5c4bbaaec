"""pagewire block service: the KV-cache memory manager (free lists, ref counts, prefix hashes).

The core (everything except `servicer.py` and `__main__.py`) is plain Python with no gRPC or
torch import, so tests and benchmarks drive it directly.
"""
