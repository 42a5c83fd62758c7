"""A tiny third-party kvx plugin for kvx's registry tests.

Importing this package must stay cheap: the connector classes live in `connectors.py`, which kvx
may import only when a connector is used (the lazy-loading test checks that).
"""
