"""An example third-party kvx connector (kept empty so plugin discovery stays cheap)."""
