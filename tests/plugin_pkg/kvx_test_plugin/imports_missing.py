"""A connector module that needs a package which is not installed."""

import kvx_test_never_installed_dependency  # noqa: F401

Connector = None
