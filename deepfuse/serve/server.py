"""Runs the app under uvicorn: builds the LLM, wraps it in an AsyncLLM, serves until Ctrl-C."""
from __future__ import annotations

import sys

from ..runtime.async_llm import AsyncLLM
from ..runtime.llm import LLM
from .app import build_app


def serve(llm: LLM, model_name: str, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          max_body_bytes: int = 1 << 20) -> None:
    """Serves llm on host:port (loopback by default) until interrupted; then stops the engine."""
    import uvicorn

    served = AsyncLLM(llm)
    app = build_app(served, model_name, api_key=api_key, max_body_bytes=max_body_bytes)
    print(f"deepfuse: serving {model_name!r} on http://{host}:{port}/v1"
          + (" (API key required)" if api_key else ""), file=sys.stderr, flush=True)
    try:
        uvicorn.run(app, host=host, port=port, log_level="warning")
    finally:
        served.shutdown()
