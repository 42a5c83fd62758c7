"""Adapters that run kvx connectors inside real engines (vLLM)."""
