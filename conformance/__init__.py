"""The kvx conformance suite (pytest plugin and `kvx conformance`)."""
