"""``pivotspec serve``: an OpenAI-compatible server that decodes with PAD (see ``app``)."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from typing import Any

from pivotspec.server.app import Settings, create_app

__all__ = ["Settings", "create_app", "serve"]


def serve(pair: Any, settings: Settings, host: str = "127.0.0.1", port: int = 8000) -> None:
    """Run the server until SIGINT or SIGTERM, then let in-flight requests finish (up to 30 s) and return
    normally, so the process exits with status 0 (uvicorn would re-raise the signal after its shutdown)."""
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            def stop(_signum: int, _frame: Any) -> None:
                self.should_exit = True

            previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    config = uvicorn.Config(create_app(pair, settings), host=host, port=port, log_level="warning",
                            timeout_graceful_shutdown=30)
    Server(config).run()
