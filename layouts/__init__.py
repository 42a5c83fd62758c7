"""KV cache layout descriptors and block transforms (registered as kvx plugins)."""
