"""Serving integrations: sparse prefill inside inference engines (vLLM, the `vllm` extra)."""
