"""Built-in kvx connectors; each registers through the `kvx` entry-point group."""
