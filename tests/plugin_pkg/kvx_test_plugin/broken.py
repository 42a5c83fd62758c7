"""A plugin whose module fails to import: kvx must record it, not crash."""

raise RuntimeError("this plugin is broken on purpose")
