"""`deepfuse serve`: an OpenAI-compatible HTTP server (app.py) over AsyncLLM."""
from .app import build_app
from .server import serve

__all__ = ["build_app", "serve"]
