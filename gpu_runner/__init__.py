"""gpu_runner: the model and its paged KV cache behind pagewire.runner.v1."""
