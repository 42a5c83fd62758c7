"""ExampleStoreConnector: example store of KV blocks in one SQLite file, reused across engines."""
