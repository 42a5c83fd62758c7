"""LMCacheConnectorV1: stores and loads KV chunks through LMCache (CPU, disk, redis://, lm://).

LMCache's engine runs on CPU or CUDA; `lmcache` is imported only when the connector is built.
"""
