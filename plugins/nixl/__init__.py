"""NixlConnector: prefill/decode hand-off: D reads P's KV blocks with NIXL (UCX) READs.

Pull mode over UCX; `nixl` is imported only when the connector is built.
"""
