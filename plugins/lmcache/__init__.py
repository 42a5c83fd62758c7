"""LMCacheConnectorV1: KV chunks stored and loaded through LMCache's engine, on CPU or CUDA."""
