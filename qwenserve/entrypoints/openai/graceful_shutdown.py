"""Graceful shutdown of the HTTP server. On SIGTERM (or Ctrl-C) the server keeps listening but admits no new
request (503 with Retry-After; /health turns 503, so a load balancer stops sending), lets the live requests run
for up to shutdown_timeout seconds, ends the rest with an error (a 503, or an error event on a stream; their KV
blocks freed), then lets uvicorn close the connections and return, and the process exits 0. A second signal
skips the wait; a third stops waiting for connections too."""
from __future__ import annotations

import asyncio
import logging
import signal
import time

import uvicorn

from qwenserve.config.server_config import SERVER_DEFAULTS
from qwenserve.engine.async_engine import AsyncLLMEngine, DrainTimeoutError

logger = logging.getLogger(__name__)

# After the drain, uvicorn's own graceful shutdown waits for open connections (the last responses being written).
# Bounded, because an idle TLS keep-alive client would otherwise hold it for asyncio's 30 s SSL shutdown timeout.
CONNECTIONS_GRACE_S = 5.0
DRAIN_POLL_S = 0.05


class GracefulServer(uvicorn.Server):
    """uvicorn.Server that drains the engine before uvicorn's own shutdown (which stops listening at once, so a
    new client would get a refused connection instead of a 503)."""

    def __init__(self, config: uvicorn.Config, engine: AsyncLLMEngine,
                 shutdown_timeout: float = SERVER_DEFAULTS.shutdown_timeout):
        if config.timeout_graceful_shutdown is None:
            config.timeout_graceful_shutdown = CONNECTIONS_GRACE_S
        super().__init__(config)
        self.engine = engine
        self.shutdown_timeout = shutdown_timeout
        self.exit_signals: list[int] = []
        self._drain_task: asyncio.Task | None = None

    def handle_exit(self, sig: int, frame) -> None:
        """Called in the signal handler: only note the signal (on_tick acts on it). Unlike uvicorn's own, the
        signal is not raised again once the server has stopped: it has been handled, and the process exits 0."""
        self.exit_signals.append(sig)
        if len(self.exit_signals) >= 3:
            self.should_exit = self.force_exit = True

    async def on_tick(self, counter: int) -> bool:
        if self.exit_signals and self._drain_task is None:
            self._drain_task = asyncio.ensure_future(self._drain())
        return await super().on_tick(counter)

    async def _drain(self) -> None:
        engine = self.engine
        try:
            engine.begin_drain()
            logger.info("%s: admitting no new requests; waiting up to %g s for %d live request(s) (signal again to "
                        "stop now)", signal.Signals(self.exit_signals[0]).name, self.shutdown_timeout,
                        engine.num_live_requests)
            deadline = time.monotonic() + self.shutdown_timeout
            while engine.num_live_requests and time.monotonic() < deadline and len(self.exit_signals) < 2:
                await asyncio.sleep(DRAIN_POLL_S)
            aborted = await engine.abort_all(DrainTimeoutError(
                f"the server shut down before this request finished (--shutdown-timeout {self.shutdown_timeout:g})"))
            if aborted:
                logger.warning("aborted %d request(s) still running at the shutdown deadline", aborted)
        except Exception:  # noqa: BLE001 - whatever failed, the server must still stop
            logger.exception("draining failed; shutting down now")
        finally:
            self.should_exit = True
