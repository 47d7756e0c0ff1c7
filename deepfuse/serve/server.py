"""Runs the app under uvicorn over an AsyncLLM (one engine here) or engine Replicas, until Ctrl-C."""
from __future__ import annotations

import sys

from ..runtime.async_llm import AsyncLLM
from ..runtime.llm import LLM
from ..runtime.replicas import Replicas
from .app import build_app


def serve(llm: AsyncLLM | LLM | Replicas, model_name: str, host: str = "127.0.0.1", port: int = 8000,
          api_key: str | None = None, max_body_bytes: int = 1 << 20) -> None:
    """Serves llm (an AsyncLLM; an LLM, run by an AsyncLLM here; or engine Replicas) on host:port
    (loopback by default) until interrupted; then stops the engine(s). `deepfuse serve` gives an
    AsyncLLM that built its LLM on its engine thread (runtime/async_llm.py: why)."""
    import uvicorn

    served = AsyncLLM(llm) if isinstance(llm, LLM) else llm
    app = build_app(served, model_name, api_key=api_key, max_body_bytes=max_body_bytes)
    where = f" on {len(llm.workers)} replicas ({llm.router.policy} routing)" if isinstance(llm, Replicas) else ""
    print(f"deepfuse: serving {model_name!r}{where} on http://{host}:{port}/v1"
          + (" (API key required)" if api_key else ""), file=sys.stderr, flush=True)
    try:
        uvicorn.run(app, host=host, port=port, log_level="warning")
    finally:
        served.shutdown()
