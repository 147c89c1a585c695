"""A TCP forwarder a test controls: one process's link to Redis that can be cut.

``TcpProxy(target_port).start()`` listens on ``127.0.0.1:<port>`` and forwards every
connection to the target, on an event loop of its own thread. ``cut()`` aborts every
connection (both sides see a reset) and closes the listener, so new connections are
refused, until ``heal()`` listens again on the same port. Nothing else is inspected or
changed: bytes pass through as they are.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading

_CHUNK = 1 << 16


class TcpProxy:
    def __init__(self, target_port: int, target_host: str = "127.0.0.1", port: int = 0) -> None:
        self.target = (target_host, target_port)
        self.port = port
        self.num_connections = 0  # accepted since start
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tcp-proxy", daemon=True)
        self._server: asyncio.Server | None = None
        self._transports: set[asyncio.Transport] = set()

    @property
    def url(self) -> str:
        """A Redis URL through the proxy."""
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> TcpProxy:
        self._thread.start()
        self._call(self._listen())
        return self

    def cut(self) -> None:
        """Drop every connection and refuse new ones."""
        self._call(self._cut())

    def heal(self) -> None:
        """Accept connections again (on the same port)."""
        self._call(self._listen())

    def stop(self) -> None:
        if self._thread.is_alive():
            self._call(self._cut())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)

    def __enter__(self) -> TcpProxy:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- on the proxy's loop ------------------------------------------------------------
    def _call(self, coro, timeout_s: float = 10.0):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    async def _listen(self) -> None:
        if self._server is None:
            self._server = await asyncio.start_server(self._accept, "127.0.0.1", self.port, reuse_address=True)
            self.port = self._server.sockets[0].getsockname()[1]

    async def _cut(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for t in list(self._transports):
            t.abort()
        self._transports.clear()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.transport.abort()
            return
        if self._server is None:  # cut while connecting
            writer.transport.abort()
            up_writer.transport.abort()
            return
        self.num_connections += 1
        self._transports |= {writer.transport, up_writer.transport}
        await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))
        self._transports -= {writer.transport, up_writer.transport}

    @staticmethod
    async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(_CHUNK):
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            with contextlib.suppress(Exception):
                writer.close()
