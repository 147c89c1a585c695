"""HTTP connections that a slow or greedy client cannot hold open (uvicorn's protocol, guarded).

``guarded_protocol(base, ...)`` subclasses uvicorn's HTTP protocol (httptools' or h11's,
whichever uvicorn picks) with three bounds:

* ``--http-header-timeout``: a request's headers must all arrive within this many seconds of
  the connection opening (or of the previous response on a kept-alive connection); a client
  sending them a byte at a time is answered 408 and closed. On a kept-alive connection it
  counts from the first byte of the next request.
* Idle kept-alive connections: one on which no byte came since its last response is closed
  quietly after ``KEEP_ALIVE_S`` (30 s; the header timeout where that is longer): no 408,
  not counted as a cut.
* ``--http-body-timeout``: while a body is being read, the gap between two of its pieces;
  past it, 408 and closed (the route sees a disconnect).
* ``--max-connections``: a connection past this many open ones is answered 503 and closed
  at once, before anything is read from it.

Each answer is a whole HTTP/1.1 response with ``Connection: close``.

uvicorn's own keep-alive timer (5 s) is not used: a server that closes an idle connection at
the very moment the client reuses it makes the client's request meet a reset (the client's
``ReadError``, a request lost). httpx expires its idle connections after 5 s of its own clock,
which starts when it has read the response, later than the server's; with both at 5 s a busy
client reused connections the server was closing (``bench token-path --backend openai``: the
server's FIN 5.000 s after the last chunk, the client's next request 7 to 20 ms later, then
RST). The idle bound is well above the clients' keep-alive expiry (httpx 5 s, aiohttp 15 s)
and any lag of a busy client, so the client is the one that gives an idle connection up.
"""

from __future__ import annotations

import asyncio

import structlog

log = structlog.get_logger("gateway")


def _answer(status: str, headers: str = "") -> bytes:
    return (f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\nconnection: close\r\n{headers}"
            f"content-length: 0\r\n\r\n").encode()


TIMEOUT = _answer("408 Request Timeout")
KEEP_ALIVE_S = 30.0
# Past --max-connections: when to come back (a client's retry backs off instead of hammering).
FULL = _answer("503 Service Unavailable", "retry-after: 1\r\n")


def guarded_protocol(base: type[asyncio.Protocol], *, header_timeout_s: float, body_timeout_s: float,
                     max_connections: int, on_refused=None,
                     keep_alive_s: float = KEEP_ALIVE_S) -> type[asyncio.Protocol]:
    """``base`` with the bounds above (``on_refused(reason)`` counts each connection cut)."""

    class Guarded(base):  # type: ignore[misc, valid-type]
        _reading: str | None = None  # "headers", "body" or None (a request is being answered)
        _timer: asyncio.TimerHandle | None = None
        _seen_cycle = None
        _idle = False  # kept alive after a response, and no byte of a next request came yet

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                self._cut(FULL, "max_connections")
                return
            self._await_headers()

        def data_received(self, data: bytes) -> None:
            if self._idle:  # the next request's first byte: its headers are due within the timeout
                self._idle = False
                self._await_headers()
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
            cycle, pipelined = self.cycle, bool(getattr(self, "pipeline", ()))  # httptools queues them
            super().on_response_complete()
            if self.transport.is_closing():
                return
            self._unset_keepalive_if_required()  # the idle bound is this guard's (see above)
            if pipelined or self.cycle is not cycle:  # a next request, read already, is being answered
                self._seen_cycle, self._reading = self.cycle, None
                self._disarm()
                return
            self._idle, self._reading = True, "headers"
            self._arm(max(keep_alive_s, header_timeout_s))

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
            if self._idle:  # a kept-alive connection nobody reused: closed, as a keep-alive timeout does
                self.transport.close()
                return
            cycle = self.cycle
            answered = (self._reading == "body" and cycle is not None and cycle is self._seen_cycle
                        and cycle.response_started)
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
