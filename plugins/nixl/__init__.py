"""NixlConnector: pull-mode P/D KV transfer over NIXL (UCX)."""
