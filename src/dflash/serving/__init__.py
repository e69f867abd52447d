"""Serving: the OpenAI-compatible HTTP server (app.py) over the engine thread (worker.py)."""

from .app import BackgroundServer, create_app

__all__ = ["BackgroundServer", "create_app"]
