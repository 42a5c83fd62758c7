"""SharedStorageConnector (alias ExampleConnector): KV blocks in shared storage, by URL.

`connector.py` builds the role's half: `scheduler.py` decides what to load and store,
`worker.py` moves the bytes, `backends/` talk to the storage (fsspec or Redis).
"""
