"""The engine: draft, verify, accept, roll back; its configs, statistics and events.

Importing this package loads no model library."""
