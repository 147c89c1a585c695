"""Kept-alive HTTP connections of the OpenAI door (gateway/http_conn.py).

A client may reuse a kept-alive connection a while after its last response: httpx keeps one
for 5 s of its own clock, which starts when it has read the response, so a busy client sends
its next request more than 5 s after the server finished the last one. The door must not close
the connection under it (uvicorn's own 5 s keep-alive did: the request met a reset, the
client's ``ReadError``). An idle kept-alive connection is kept ``KEEP_ALIVE_S`` (30 s),
whatever ``--http-header-timeout``; that timeout counts from the next request's first byte.
"""

from __future__ import annotations

import json
import socket
import time
from urllib.parse import urlsplit

import pytest
from cluster_fixtures import start_cluster

HEADER_TIMEOUT_S = 2.0
REUSE_AFTER_S = 5.5  # past uvicorn's 5 s keep-alive, httpx's 5 s expiry and the header timeout
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = start_cluster(tmp_path_factory.mktemp("http-keepalive"), num_workers=1, http_port=0,
                      worker_args=["--engine", "sim", "--time-scale", "20"],
                      gateway_args=["--http-header-timeout", str(HEADER_TIMEOUT_S)])
    yield c
    c.stop()


def _stream_request(host: str) -> bytes:
    body = json.dumps({"model": "tiny", "prompt": [65, 66, 67, 68], "max_tokens": MAX_TOKENS, "stream": True,
                       "ignore_eos": True, "stream_options": {"include_usage": True}}).encode()
    return (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


def _read_response(s: socket.socket) -> bytes:
    """One chunked SSE response, to its last chunk; what a reset or a close before it gives is raised."""
    data = b""
    while not data.endswith(b"0\r\n\r\n"):
        piece = s.recv(65536)  # ConnectionResetError where the server reset the connection
        if not piece:
            raise AssertionError(f"the server closed the connection mid-response: {data[-200:]!r}")
        data += piece
    return data


def _check_whole(response: bytes) -> None:
    assert response.startswith(b"HTTP/1.1 200"), response[:200]
    chunks = [json.loads(line[6:]) for line in response.decode().split("\n")
              if line.startswith("data: {")]
    assert [c for c in chunks if c.get("usage")][-1]["usage"]["completion_tokens"] == MAX_TOKENS
    assert b"data: [DONE]" in response


def test_kept_alive_connection_reused_after_five_seconds_then_header_timeout_from_first_byte(cluster):
    u = urlsplit(cluster.http_url)
    with socket.create_connection((u.hostname, u.port), timeout=30) as s:
        s.sendall(_stream_request(u.netloc))
        _check_whole(_read_response(s))
        time.sleep(REUSE_AFTER_S)
        s.sendall(_stream_request(u.netloc))  # the same connection, as a pooled client reuses it
        try:
            second = _read_response(s)
        except ConnectionResetError as e:
            raise AssertionError(f"a request on a kept-alive connection {REUSE_AFTER_S}s idle met a reset") from e
        _check_whole(second)
        # Idle past the header timeout, then headers that never end: 408 a header timeout after
        # their first byte.
        time.sleep(HEADER_TIMEOUT_S + 1)
        first_byte = time.monotonic()
        s.sendall(b"GET /version HTTP/1.1\r\nHost: x\r\n")
        s.settimeout(HEADER_TIMEOUT_S + 10)
        assert s.recv(200).startswith(b"HTTP/1.1 408")
        waited = time.monotonic() - first_byte
        assert HEADER_TIMEOUT_S - 0.5 < waited < HEADER_TIMEOUT_S + 5, waited
