"""SharedStorageConnector: stores full KV blocks by prefix hash in files, object stores or Redis.

Alias ExampleConnector. `connector.py` builds the role's half: `scheduler.py` decides what to
load and store, `worker.py` moves the bytes, `backends/` talk to the storage (fsspec or Redis).
"""
