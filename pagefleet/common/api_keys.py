"""API keys of the public doors: where they come from, how a presented key is checked.

Keys come from ``--api-key KEY`` (repeatable; ``PAGEFLEET_API_KEY``, comma-separated) and
``--api-keys-file PATH`` (one key a line, ``#`` comments; read again on SIGHUP). With none,
the doors are open, as they always were. A client sends ``authorization: Bearer <key>``
(gRPC metadata, or the HTTP header the OpenAI clients send).

A presented key is hashed and compared with every key's hash (``hmac.compare_digest``, all of
them, no early exit), so neither its length nor which key it nearly matches shows in the time
taken. Keys are never logged: logs and spans name a key by its id, the first 12 hex digits of
its SHA-256 (``key_id``), which is why keys must be long random strings (at least
``MIN_KEY_LEN`` characters): a short one could be guessed back from its id.

The key of the call being served is known to the code it calls through ``caller``: its id is
bound to every log line (``api_key_id``) and read by the doors' spans (``current_key_id``).
"""

from __future__ import annotations

import argparse
import contextlib
import contextvars
import hashlib
import hmac
from collections.abc import Iterable, Iterator
from pathlib import Path

import structlog

MIN_KEY_LEN = 16
LOG_FIELD = "api_key_id"
SPAN_ATTRIBUTE = "pagefleet.api_key_id"
log = structlog.get_logger("auth")
_current: contextvars.ContextVar[str | None] = contextvars.ContextVar("pagefleet_api_key_id", default=None)


class Unauthenticated(ValueError):
    """No key, or not one of ours; the message says which, and never repeats the key."""


def key_id(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:12]


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def parse_keys(text: str) -> list[str]:
    """The keys of a keys file: one a line; blank lines and ``#`` comments skipped."""
    lines = (line.split("#", 1)[0].strip() for line in text.splitlines())
    return [line for line in lines if line]


class ApiKeys:
    """The keys a door accepts. ``required`` is fixed when it is made: a door that needed a key
    keeps needing one, even if a reload finds no key at all (then every call is refused)."""

    def __init__(self, keys: Iterable[str] = (), file: str | None = None) -> None:
        self.fixed = list(keys)
        self.file = file
        self.required = bool(self.fixed) or file is not None
        self._digests: list[tuple[bytes, str]] = []
        self._load(self.fixed + (self._read_file() if file else []))

    @classmethod
    def from_args(cls, args) -> ApiKeys:
        return cls(args.api_key or (), args.api_keys_file)

    @property
    def num_keys(self) -> int:
        return len(self._digests)

    def _read_file(self) -> list[str]:
        try:
            return parse_keys(Path(self.file).read_text())
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--api-keys-file {self.file}: {getattr(e, 'strerror', None) or e}") from None

    def _load(self, keys: list[str]) -> None:
        short = next((i for i, k in enumerate(keys) if len(k) < MIN_KEY_LEN), None)
        if short is not None:  # named by its place: even the id of a short key would give it away
            raise ValueError(f"API keys must be at least {MIN_KEY_LEN} characters; key {short + 1} of {len(keys)} "
                             f"has {len(keys[short])} (make them with `pagefleet certs` or `openssl rand -hex 32`)")
        self._digests = [(_digest(k), key_id(k)) for k in dict.fromkeys(keys)]

    def reload(self) -> None:
        """Read the keys file again (SIGHUP). A file that cannot be read, or holds a key too
        short, changes nothing (logged)."""
        if self.file is None:
            return
        try:
            self._load(self.fixed + self._read_file())
        except ValueError as e:
            log.error("api_keys.reload_failed", error=str(e), num_keys=self.num_keys)
            return
        if not self._digests:
            log.warning("api_keys.none", file=self.file, note="every call is refused until a key is added")
        log.info("api_keys.loaded", num_keys=self.num_keys, key_ids=[kid for _, kid in self._digests])

    def check(self, authorization: str | None) -> str:
        """The id of the key ``authorization`` (``Bearer <key>``) carries; ``Unauthenticated``
        when there is none or it is not one of ours."""
        if not authorization:
            raise Unauthenticated("missing API key: send the header `authorization: Bearer <key>`")
        scheme, _, presented = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not presented.strip():
            raise Unauthenticated("malformed authorization: expected `Bearer <key>`")
        digest = _digest(presented.strip())
        found = None
        for known, kid in self._digests:
            if hmac.compare_digest(known, digest):
                found = kid
        if found is None:
            raise Unauthenticated("invalid API key")
        return found

    def accepts(self, authorization: str | None) -> bool:
        """Whether ``check`` would accept ``authorization``."""
        try:
            self.check(authorization)
        except Unauthenticated:
            return False
        return True


def add_api_key_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--api-key", action="append", default=None, metavar="KEY",
                        help="require this key (`authorization: Bearer KEY`) on every call but health "
                             "(repeatable; the variable takes a comma-separated list; default: no key needed)")
    parser.add_argument("--api-keys-file", default=None, metavar="PATH",
                        help="require one of the keys in this file (one a line; read again on SIGHUP)")


@contextlib.contextmanager
def caller(kid: str) -> Iterator[None]:
    """Serve one call as the key ``kid``: its id on every log line and for ``current_key_id``."""
    token = _current.set(kid)
    bound = structlog.contextvars.bind_contextvars(**{LOG_FIELD: kid})
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):  # a stream closed from another context: nothing to undo
            structlog.contextvars.reset_contextvars(**bound)
            _current.reset(token)


def current_key_id() -> str | None:
    """The id of the key the call being served came with (None: no key needed)."""
    return _current.get()
