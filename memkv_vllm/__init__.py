"""memkv-vllm: an open KV-cache cluster (memkv) and the vLLM plugin backed by it."""
