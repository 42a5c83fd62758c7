"""Storage backends of the SharedStorageConnector, chosen by URL scheme through the registry."""
