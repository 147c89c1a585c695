"""HTTP connections that a slow or greedy client cannot hold open (uvicorn's protocol, guarded).

``guarded_protocol(base, ...)`` subclasses uvicorn's HTTP protocol (httptools' or h11's,
whichever uvicorn picks) with three bounds:

* ``--http-header-timeout``: a request's headers must all arrive within this many seconds of
  the connection opening (or of the previous response on a kept-alive connection); a client
  sending them a byte at a time is answered 408 and closed.
* ``--http-body-timeout``: while a body is being read, the gap between two of its pieces;
  past it, 408 and closed (the route sees a disconnect).
* ``--max-connections``: a connection past this many open ones is answered 503 and closed
  at once, before anything is read from it.

Each answer is a whole HTTP/1.1 response with ``Connection: close``.
"""

from __future__ import annotations

import asyncio

import structlog

log = structlog.get_logger("gateway")


def _answer(status: str) -> bytes:
    return (f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\nconnection: close\r\n"
            f"content-length: 0\r\n\r\n").encode()


TIMEOUT = _answer("408 Request Timeout")
FULL = _answer("503 Service Unavailable")


def guarded_protocol(base: type[asyncio.Protocol], *, header_timeout_s: float, body_timeout_s: float,
                     max_connections: int, on_refused=None) -> type[asyncio.Protocol]:
    """``base`` with the bounds above (``on_refused(reason)`` counts each connection cut)."""

    class Guarded(base):  # type: ignore[misc, valid-type]
        _reading: str | None = None  # "headers", "body" or None (a request is being answered)
        _timer: asyncio.TimerHandle | None = None
        _seen_cycle = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                self._cut(FULL, "max_connections")
                return
            self._await_headers()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.transport.is_closing():
                return
            cycle = self.cycle
            if cycle is not None and cycle is not self._seen_cycle:  # a new request's headers are in
                self._seen_cycle = cycle
                self._reading = "body" if cycle.more_body else None
                self._arm(body_timeout_s) if cycle.more_body else self._disarm()
            elif self._reading == "body":
                if cycle.more_body:
                    self._arm(body_timeout_s)  # the gap between pieces of the body
                else:
                    self._reading = None
                    self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._await_headers()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _await_headers(self) -> None:
            self._reading = "headers"
            self._arm(header_timeout_s)  # from now, not from each byte: a slow trickle still ends

        def _arm(self, seconds: float) -> None:
            self._disarm()
            self._timer = asyncio.get_running_loop().call_later(seconds, self._timed_out)

        def _disarm(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

        def _timed_out(self) -> None:
            self._timer = None
            if self._reading is None or self.transport.is_closing():
                return
            cycle = self.cycle
            answered = cycle is not None and cycle is self._seen_cycle and cycle.response_started
            self._cut(None if answered else TIMEOUT, f"{self._reading}_timeout")

        def _cut(self, answer: bytes | None, reason: str) -> None:
            log.info("http.connection_cut", reason=reason, client=str(self.client))
            if on_refused is not None:
                on_refused(reason)
            if answer is not None:
                self.transport.write(answer)
            self.transport.close()

    Guarded.__name__ = Guarded.__qualname__ = f"Guarded{base.__name__}"
    return Guarded
