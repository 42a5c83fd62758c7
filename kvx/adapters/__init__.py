"""Adapters that run kvx connectors inside real engines (vLLM)."""

VLLM_PREFIX = "kvx."
"""How vLLM names a kvx connector by its registry name (`kvx.<name>`), without a module path."""
