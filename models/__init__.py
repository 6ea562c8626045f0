"""Holds registry.toml; installed as the package cactus_edge.model_registry so it ships in wheels."""
