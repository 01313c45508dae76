"""``pivotspec serve``: an OpenAI-compatible server that decodes with PAD (see ``app``)."""

from __future__ import annotations

from pivotspec.server.app import Settings, create_app

__all__ = ["Settings", "create_app", "serve"]


def serve(pair, settings: Settings, host: str = "127.0.0.1", port: int = 8000) -> None:  # noqa: ANN001
    """Run the server until SIGINT/SIGTERM; uvicorn finishes in-flight requests (up to 30 s) on shutdown."""
    import uvicorn

    uvicorn.run(create_app(pair, settings), host=host, port=port, log_level="warning",
                timeout_graceful_shutdown=30)
