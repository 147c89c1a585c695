"""TLS on pagefleet's ports: the public doors' certificate and the cluster's mutual TLS.

Two sets of flags, each all-or-nothing (none given: plaintext, as before):

* public, the gateway's gRPC and HTTP doors and its metrics: ``--tls-cert`` and ``--tls-key``;
  with ``--tls-client-ca`` a client must also show a certificate that CA signed for client use.
* cluster, between the scheduler and the workers: ``--cluster-ca``, ``--cluster-cert`` and
  ``--cluster-key`` on both sides. A worker (and the scheduler's own view and metrics) completes
  a handshake only with a peer whose certificate chains to the cluster CA, is valid now and is
  issued for client use; the scheduler dials a worker only if the worker's certificate chains to
  the same CA and names ``--worker-tls-name`` (not the advertised address, often a pod IP).

Refusals happen in the handshake: no call reaches a servicer, so none costs Redis work. A
``Tls`` is the three files one side needs; it turns into gRPC credentials or an ``ssl`` context.
"""

from __future__ import annotations

import argparse
import ssl
from dataclasses import dataclass
from pathlib import Path

# The name every worker's certificate carries; the scheduler checks it (``--worker-tls-name``)
# instead of the address a worker advertises, which is often a pod IP nobody can predict.
WORKER_TLS_NAME = "pagefleet-worker"
SCHEDULER_TLS_NAME = "pagefleet-scheduler"


@dataclass(frozen=True, slots=True)
class Tls:
    """This side's certificate and key, and the CA its peers' certificates must chain to
    (None: a server asks for no client certificate; a client trusts the system's roots)."""

    cert: str
    key: str
    ca: str | None = None

    def server_credentials(self):
        """gRPC server credentials; a client certificate is required when ``ca`` is set."""
        import grpc

        return grpc.ssl_server_credentials([(read(self.key), read(self.cert))],
                                           root_certificates=read(self.ca) if self.ca else None,
                                           require_client_auth=self.ca is not None)

    def channel_credentials(self):
        """gRPC channel credentials: this certificate, and ``ca`` to check the server's."""
        return channel_credentials(self.ca, self.cert, self.key)

    def server_context(self, *, verify_clients: bool = True) -> ssl.SSLContext:
        """An ``ssl`` context for an HTTP server; it requires a client certificate signed by
        ``ca`` when ``ca`` is set and ``verify_clients``."""
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        _load(ctx.load_cert_chain, self.cert, self.key)
        if self.ca and verify_clients:
            _load(ctx.load_verify_locations, self.ca)
            ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx


def read(path: str) -> bytes:
    """A PEM file's bytes; ``ValueError`` naming the file when it cannot be read."""
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror or e}") from None


def _load(fn, *paths: str) -> None:
    try:
        fn(*paths)
    except (OSError, ssl.SSLError) as e:
        raise ValueError(f"cannot load {' and '.join(paths)}: {e}") from None


def channel_credentials(ca: str | None, cert: str | None = None, key: str | None = None):
    """gRPC channel credentials: trust ``ca`` (None: the system's roots), show ``cert`` if given."""
    import grpc

    if (cert is None) != (key is None):
        raise ValueError("a client certificate needs its key, and a key its certificate")
    return grpc.ssl_channel_credentials(root_certificates=read(ca) if ca else None,
                                        private_key=read(key) if key else None,
                                        certificate_chain=read(cert) if cert else None)


def client_context(ca: str | None, cert: str | None = None, key: str | None = None) -> ssl.SSLContext:
    """An ``ssl`` context for an HTTPS client: trust ``ca`` (None: the system's), show ``cert``."""
    ctx = ssl.create_default_context(cafile=ca)
    if cert is not None:
        _load(ctx.load_cert_chain, cert, key)
    return ctx


def dialer(tls: Tls | None, server_name: str | None = None):
    """``dial(address) -> grpc.aio.Channel``: plaintext without ``tls``; else mutual TLS, and
    the server's certificate must name ``server_name`` (None: the address's host)."""
    import grpc

    from pagefleet.common.service import CHANNEL_OPTIONS

    if tls is None:
        return lambda address: grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
    credentials = tls.channel_credentials()
    options = [*CHANNEL_OPTIONS, *([("grpc.ssl_target_name_override", server_name)] if server_name else [])]
    return lambda address: grpc.aio.secure_channel(address, credentials, options=options)


def add_port(server, address: str, tls: Tls | None) -> int:
    """Listen on ``address`` with TLS (``tls``) or in plaintext (None); the bound port. One that
    cannot be bound (taken by another process) ends this one with a line naming it, not grpc's
    traceback."""
    try:
        return server.add_insecure_port(address) if tls is None else \
            server.add_secure_port(address, tls.server_credentials())
    except RuntimeError as e:
        raise SystemExit(f"{address}: cannot listen there (in use by another process?): {e}") from None


# -- flags ---------------------------------------------------------------------------------------
def add_public_tls_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tls-cert", default=None, metavar="PATH",
                        help="serve gRPC, HTTP and metrics over TLS with this certificate (PEM, chain first)")
    parser.add_argument("--tls-key", default=None, metavar="PATH", help="the private key of --tls-cert (PEM)")
    parser.add_argument("--tls-client-ca", default=None, metavar="PATH",
                        help="also require a client certificate signed by this CA (PEM)")


def public_tls(args) -> Tls | None:
    """The public doors' TLS; ``ValueError`` naming the flag missing."""
    cert, key, ca = args.tls_cert, args.tls_key, args.tls_client_ca
    if cert is None and key is None:
        if ca is not None:
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key")
        return None
    if cert is None or key is None:
        raise ValueError("--tls-cert and --tls-key go together")
    return Tls(cert, key, ca)


def add_cluster_tls_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cluster-ca", default=None, metavar="PATH",
                        help="mutual TLS inside the cluster: the CA every scheduler and worker certificate "
                             "chains to (PEM; with --cluster-cert and --cluster-key)")
    parser.add_argument("--cluster-cert", default=None, metavar="PATH", help="this process's cluster certificate (PEM)")
    parser.add_argument("--cluster-key", default=None, metavar="PATH", help="the private key of --cluster-cert (PEM)")


def cluster_tls(args) -> Tls | None:
    """The cluster's mutual TLS; ``ValueError`` naming the flags missing."""
    given = {"--cluster-ca": args.cluster_ca, "--cluster-cert": args.cluster_cert, "--cluster-key": args.cluster_key}
    missing = [flag for flag, value in given.items() if value is None]
    if len(missing) == len(given):
        return None
    if missing:
        raise ValueError(f"mutual TLS needs {', '.join(missing)} too (all of --cluster-ca, --cluster-cert, --cluster-key)")
    return Tls(args.cluster_cert, args.cluster_key, args.cluster_ca)


def check_files(tls: Tls | None) -> None:
    """Load ``tls``'s files once, so a missing or malformed one stops the process at start
    (``ValueError`` naming it) rather than at the first handshake."""
    if tls is not None:
        tls.server_context()
