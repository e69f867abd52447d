"""Serving: the OpenAI-compatible HTTP server (app.py; the Responses API in responses.py, Anthropic's Messages API
in messages.py) over the engine thread (worker.py)."""

from .app import BackgroundServer, create_app

__all__ = ["BackgroundServer", "create_app"]
