"""Bounds on what one caller may ask of a gateway; every refusal names the flag it hit.

=========================== ============ ==========================================================
flag                        default      bounds
=========================== ============ ==========================================================
``--max-request-bytes``     4 MiB        one gRPC message (``grpc.max_receive_message_length``:
                                         RESOURCE_EXHAUSTED with gRPC's own text, which gives the
                                         bound), one HTTP body (413)
``--max-prompt-chars``      1,048,576    a text prompt, or a chat's messages together, before they
                                         are tokenized (INVALID_ARGUMENT / 400)
``--max-choices``           128          prompts x ``n`` of one HTTP request (400)
``--max-stop-strings``      64           stop strings of one request (at most the engine's 64)
``--max-stop-string-len``   256          characters of each stop string (at most the engine's 256)
``--max-concurrent-streams`` 1024        Generate calls open at once on one gRPC connection
                                         (RESOURCE_EXHAUSTED); HTTP/2 lets a connection open
                                         ``STREAM_HEADROOM`` more streams, for Cancel and health
``--max-connections``       1024         HTTP connections open at once; one past it is answered
                                         503 and closed before anything is read (http_conn.py)
``--http-header-timeout``   10 s         a request's headers, from the connection (or, kept
                                         alive, from their first byte) to their end; past it,
                                         408 and closed (an idle kept-alive connection: 30 s)
``--http-body-timeout``     30 s         the gap between two pieces of a body; past it, 408
=========================== ============ ==========================================================

The prompt's tokens are bounded already by the model's context (``--max-model-len``).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from pagefleet.common.sampling_params import MAX_STOP_STRING_LEN, MAX_STOP_STRINGS

MAX_CHOICES = 128
# Streams a connection may open beyond --max-concurrent-streams Generate calls: its Cancel and
# health calls, and the Generate calls past the limit, which are then refused by name rather
# than left waiting for a stream.
STREAM_HEADROOM = 16


class TooLarge(ValueError):
    """A request body grew past ``--max-request-bytes`` while it was read."""


@dataclass(frozen=True, slots=True)
class Limits:
    max_request_bytes: int = 4 << 20
    max_prompt_chars: int = 1 << 20
    max_choices: int = MAX_CHOICES
    max_stop_strings: int = MAX_STOP_STRINGS
    max_stop_string_len: int = MAX_STOP_STRING_LEN
    max_concurrent_streams: int = 1024
    max_connections: int = 1024
    http_header_timeout: float = 10.0
    http_body_timeout: float = 30.0

    @classmethod
    def from_args(cls, args) -> Limits:
        """From the flags; ``ValueError`` naming one out of range."""
        d = cls()
        limits = cls(args.max_request_bytes, args.max_prompt_chars, args.max_choices, args.max_stop_strings,
                     args.max_stop_string_len, args.max_concurrent_streams,
                     getattr(args, "max_connections", d.max_connections),
                     getattr(args, "http_header_timeout", d.http_header_timeout),
                     getattr(args, "http_body_timeout", d.http_body_timeout))
        for name in cls.__slots__:
            if getattr(limits, name) <= 0 or (name.startswith("max") and getattr(limits, name) < 1):
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(limits, name)}")
        if limits.max_stop_strings > MAX_STOP_STRINGS:
            raise ValueError(f"--max-stop-strings must be at most the engine's {MAX_STOP_STRINGS}")
        if limits.max_stop_string_len > MAX_STOP_STRING_LEN:
            raise ValueError(f"--max-stop-string-len must be at most the engine's {MAX_STOP_STRING_LEN}")
        return limits

    @property
    def grpc_max_streams(self) -> int:
        """HTTP/2's bound on one connection's open streams (``grpc.max_concurrent_streams``)."""
        return self.max_concurrent_streams + STREAM_HEADROOM

    def prompt_error(self, num_chars: int) -> str | None:
        if num_chars > self.max_prompt_chars:
            return f"{num_chars} characters; at most {self.max_prompt_chars} (--max-prompt-chars)"
        return None

    def stop_error(self, stop) -> str | None:
        if len(stop) > self.max_stop_strings:
            return f"{len(stop)} stop strings; at most {self.max_stop_strings} (--max-stop-strings)"
        longest = max((len(s) for s in stop), default=0)
        if longest > self.max_stop_string_len:
            return f"a stop string of {longest} characters; at most {self.max_stop_string_len} (--max-stop-string-len)"
        return None

    def choices_error(self, num_prompts: int, n: int) -> str | None:
        if num_prompts * n > self.max_choices:
            return f"{num_prompts} prompts x n = {num_prompts * n} choices; at most {self.max_choices} per request " \
                   f"(--max-choices)"
        return None

    def body_error(self, num_bytes: int) -> str | None:
        if num_bytes > self.max_request_bytes:
            return f"the request body is more than {self.max_request_bytes} bytes (--max-request-bytes)"
        return None

    def streams_error(self, num_open: int) -> str | None:
        """``num_open``: Generate calls this connection has open, counting the new one."""
        if num_open > self.max_concurrent_streams:
            return f"at most {self.max_concurrent_streams} Generate calls at once on one connection " \
                   f"(--max-concurrent-streams); open another connection or wait"
        return None


def add_limit_flags(parser: argparse.ArgumentParser) -> None:
    d = Limits()
    parser.add_argument("--max-request-bytes", type=int, default=d.max_request_bytes, metavar="N",
                        help="largest gRPC message or HTTP body a client may send")
    parser.add_argument("--max-prompt-chars", type=int, default=d.max_prompt_chars, metavar="N",
                        help="longest text prompt (a chat: its messages together), checked before tokenizing")
    parser.add_argument("--max-choices", type=int, default=d.max_choices, metavar="N",
                        help="most choices (prompts x n) one HTTP request may ask for")
    parser.add_argument("--max-stop-strings", type=int, default=d.max_stop_strings, metavar="N",
                        help=f"most stop strings one request may give (at most {MAX_STOP_STRINGS})")
    parser.add_argument("--max-stop-string-len", type=int, default=d.max_stop_string_len, metavar="N",
                        help=f"longest stop string, in characters (at most {MAX_STOP_STRING_LEN})")
    parser.add_argument("--max-concurrent-streams", type=int, default=d.max_concurrent_streams, metavar="N",
                        help="most Generate calls one gRPC connection may have open at once")
    parser.add_argument("--max-connections", type=int, default=d.max_connections, metavar="N",
                        help="most HTTP connections open at once (one past it: 503, closed)")
    parser.add_argument("--http-header-timeout", type=float, default=d.http_header_timeout, metavar="S",
                        help="seconds a client has to send a request's headers (408, closed)")
    parser.add_argument("--http-body-timeout", type=float, default=d.http_body_timeout, metavar="S",
                        help="seconds between two pieces of a request body (408, closed)")
