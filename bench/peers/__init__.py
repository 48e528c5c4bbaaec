"""Benchmark peers: other engines run on the same model and workload as pagewire."""
