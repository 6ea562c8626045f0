"""The Textual chat app, installed as ``cactus_edge.tui``."""

from .app import CactusChatApp

__all__ = ["CactusChatApp"]
