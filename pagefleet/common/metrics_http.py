"""The ``/metrics`` HTTP server: prometheus_client's WSGI app behind optional TLS and a key.

``start(port, registry, host, tls=..., authorize=...)`` serves from daemon threads. With
``tls`` (an ``ssl.SSLContext``) every connection is TLS; the handshake runs in the
connection's own thread, so a slow or plaintext client holds up nobody else, and a failed one
(no certificate, one from another CA, an expired one) is dropped quietly. ``authorize``,
when given, sees each request's ``Authorization`` header and refuses with 401 unless it
returns True.
"""

from __future__ import annotations

import socket
import ssl
import threading
from collections.abc import Callable
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

HANDSHAKE_TIMEOUT_S = 10.0


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format, *args) -> None:  # noqa: A002 - the base class's name
        pass


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True
    tls: ssl.SSLContext | None = None

    def finish_request(self, request, client_address) -> None:
        if self.tls is not None:
            request.settimeout(HANDSHAKE_TIMEOUT_S)
            try:
                request = self.tls.wrap_socket(request, server_side=True)
            except (ssl.SSLError, OSError):
                return  # refused in the handshake: nothing to answer
            request.settimeout(None)
        super().finish_request(request, client_address)

    def handle_error(self, request, client_address) -> None:
        pass  # a client that went away mid-request; nothing to log


class _Server6(_Server):
    address_family = socket.AF_INET6


def _guarded(app, authorize: Callable[[str | None], bool]):
    def guarded(environ, start_response):
        if not authorize(environ.get("HTTP_AUTHORIZATION")):
            start_response("401 Unauthorized", [("Content-Type", "text/plain; charset=utf-8"),
                                                 ("WWW-Authenticate", "Bearer")])
            return [b"an API key is required: send the header `Authorization: Bearer <key>`\n"]
        return app(environ, start_response)

    return guarded


def start(port: int, registry: CollectorRegistry, host: str, *, tls: ssl.SSLContext | None = None,
          authorize: Callable[[str | None], bool] | None = None) -> WSGIServer:
    """A running server (``server_address[1]`` is its port; ``shutdown()``, ``server_close()``)."""
    app = make_wsgi_app(registry)
    if authorize is not None:
        app = _guarded(app, authorize)
    cls = _Server6 if ":" in host else _Server
    httpd = make_server(host, port, app, cls, handler_class=_QuietHandler)
    httpd.tls = tls
    threading.Thread(target=httpd.serve_forever, name="metrics", daemon=True).start()
    return httpd
