"""Throwaway credentials: a CA, certificates it signs, API keys, a Redis password.

For ``pagefleet up --secure``, ``pagefleet certs`` (files for docker compose) and the tests.
Production material should come from your own PKI or cert-manager (docs/OPERATIONS.md).
Torch-free; needs only the ``cryptography`` package.

    ca = new_ca()
    server = issue(ca, "gateway", hosts=["127.0.0.1", "localhost"], usages=SERVER)
    files = server.write(directory, "gateway")     # gateway.pem, gateway-key.pem (0600)

Keys are ECDSA P-256. Every certificate carries an extended key usage: a certificate issued
only for ``SERVER`` cannot authenticate a client, so a gateway's certificate opens no worker.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import secrets
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from pagefleet.common.tls import SCHEDULER_TLS_NAME, WORKER_TLS_NAME

SERVER = (ExtendedKeyUsageOID.SERVER_AUTH,)
CLIENT = (ExtendedKeyUsageOID.CLIENT_AUTH,)
SERVER_AND_CLIENT = SERVER + CLIENT
LOCAL_HOSTS = ("127.0.0.1", "localhost")
DEFAULT_DAYS = 30


@dataclass(frozen=True, slots=True)
class CertFiles:
    """A certificate and its private key, as PEM files."""

    cert: str
    key: str


@dataclass(frozen=True, slots=True)
class Issued:
    """A certificate and its private key, in memory."""

    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey = field(repr=False)

    def cert_pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)

    def key_pem(self) -> bytes:
        return self.key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                      serialization.NoEncryption())

    def write(self, directory: str | Path, name: str) -> CertFiles:
        """``<name>.pem`` and ``<name>-key.pem`` (readable by this user only) in ``directory``."""
        cert = Path(directory) / f"{name}.pem"
        cert.write_bytes(self.cert_pem())
        key = Path(directory) / f"{name}-key.pem"
        write_private(key, self.key_pem())
        return CertFiles(str(cert), str(key))


def write_private(path: str | Path, data: bytes | str) -> None:
    """Write ``data`` to a file only this user can read (created so: never briefly readable)."""
    raw = data.encode() if isinstance(data, str) else data
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(raw)


def _validity(days: int, not_before: dt.datetime | None, not_after: dt.datetime | None) -> tuple[dt.datetime, dt.datetime]:
    start = not_before or dt.datetime.now(dt.UTC) - dt.timedelta(minutes=5)  # some clock skew
    return start, not_after or start + dt.timedelta(days=days)


def new_ca(name: str = "pagefleet throwaway CA", *, days: int = DEFAULT_DAYS,
           not_before: dt.datetime | None = None, not_after: dt.datetime | None = None) -> Issued:
    """A self-signed certificate authority."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    start, end = _validity(days, not_before, not_after)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject).issuer_name(subject).public_key(key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(start).not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                     content_commitment=False, key_encipherment=False, data_encipherment=False,
                                     key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return Issued(cert, key)


def issue(ca: Issued, name: str, *, hosts: Sequence[str] = (), usages=SERVER_AND_CLIENT, days: int = DEFAULT_DAYS,
          not_before: dt.datetime | None = None, not_after: dt.datetime | None = None) -> Issued:
    """A certificate for ``name`` signed by ``ca``; ``hosts`` (IP addresses or DNS names) become
    its subject alternative names, ``usages`` its extended key usages (``SERVER``, ``CLIENT``)."""
    key = ec.generate_private_key(ec.SECP256R1())
    start, end = _validity(days, not_before, not_after)
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(ca.cert.subject).public_key(key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(start).not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=False, crl_sign=False,
                                     content_commitment=False, key_encipherment=False, data_encipherment=False,
                                     key_agreement=True, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage(list(usages)), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca.key.public_key()), critical=False)
    )
    if hosts:
        builder = builder.add_extension(x509.SubjectAlternativeName([_san(h) for h in hosts]), critical=False)
    return Issued(builder.sign(ca.key, hashes.SHA256()), key)


def _san(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def new_api_key() -> str:
    """A random API key (256 bits, URL-safe): ``pf-`` and 43 characters."""
    return "pf-" + secrets.token_urlsafe(32)


def new_password() -> str:
    return secrets.token_urlsafe(24)


@dataclass(frozen=True, slots=True)
class ClusterMaterial:
    """What a secure cluster starts with, as files under ``dir`` (``write_cluster_material``).

    ``authority`` (the CA with its key) stays in memory: it is never written, so nothing on
    disk can issue more certificates.
    """

    dir: str
    ca: str  # the CA certificate: what clients and every component trust
    gateway: CertFiles  # the public doors (gRPC, HTTP, the gateway's metrics): server only
    scheduler: CertFiles  # server (its view, its metrics) and client (of the workers)
    worker: CertFiles  # every worker's: server only, named WORKER_TLS_NAME
    client: CertFiles  # an operator's (tests, `pagefleet up` itself): client only
    api_key: str = field(repr=False)
    api_keys_file: str
    redis_password: str = field(repr=False)
    redis_password_file: str
    authority: Issued = field(repr=False)

    def gateway_flags(self) -> list[str]:
        return ["--tls-cert", self.gateway.cert, "--tls-key", self.gateway.key, "--api-keys-file", self.api_keys_file]

    def cluster_flags(self, files: CertFiles) -> list[str]:
        """``--cluster-*`` for the scheduler (``self.scheduler``) or a worker (``self.worker``)."""
        return ["--cluster-ca", self.ca, "--cluster-cert", files.cert, "--cluster-key", files.key]

    def redis_flags(self) -> list[str]:
        return ["--redis-password-file", self.redis_password_file]


def write_cluster_material(directory: str | Path, hosts: Sequence[str] = LOCAL_HOSTS,
                           days: int = DEFAULT_DAYS) -> ClusterMaterial:
    """A fresh CA, a certificate for every component, an API key and a Redis password, written
    to ``directory`` (which should be readable by this user only). ``hosts``: the names and
    addresses clients dial the gateway and the scheduler by."""
    d = Path(directory)
    ca = new_ca(days=days)
    (d / "ca.pem").write_bytes(ca.cert_pem())
    api_key, password = new_api_key(), new_password()
    write_private(d / "api-keys.txt", api_key + "\n")
    write_private(d / "redis-password", password)
    return ClusterMaterial(
        dir=str(d), ca=str(d / "ca.pem"),
        gateway=issue(ca, "pagefleet-gateway", hosts=hosts, usages=SERVER, days=days).write(d, "gateway"),
        scheduler=issue(ca, SCHEDULER_TLS_NAME, hosts=[SCHEDULER_TLS_NAME, *hosts], usages=SERVER_AND_CLIENT,
                        days=days).write(d, "scheduler"),
        worker=issue(ca, WORKER_TLS_NAME, hosts=[WORKER_TLS_NAME, *hosts], usages=SERVER, days=days).write(d, "worker"),
        client=issue(ca, "pagefleet-client", usages=CLIENT, days=days).write(d, "client"),
        api_key=api_key, api_keys_file=str(d / "api-keys.txt"),
        redis_password=password, redis_password_file=str(d / "redis-password"),
        authority=ca,
    )


def main(argv: list[str]) -> int:
    """``pagefleet certs DIR``: throwaway material for a secure docker compose (or a trial)."""
    import argparse

    p = argparse.ArgumentParser(prog="pagefleet certs",
                          description="Write a throwaway CA, a certificate for every component, an API key and a "
                                      "Redis password into DIR (see docs/OPERATIONS.md, Security).")
    p.add_argument("dir", help="where to write them (created readable by this user only)")
    p.add_argument("--host", action="append", default=None, metavar="NAME",
                   help="a name or address clients reach the gateway by (repeatable; always: 127.0.0.1, "
                        "localhost, gateway, scheduler)")
    p.add_argument("--days", type=int, default=365, help="validity of every certificate")
    args = p.parse_args(argv)
    d = Path(args.dir)
    d.mkdir(parents=True, exist_ok=True)
    d.chmod(0o700)
    hosts = list(dict.fromkeys([*LOCAL_HOSTS, "gateway", "scheduler", *(args.host or ())]))
    m = write_cluster_material(d, hosts, days=args.days)
    print(f"wrote {m.dir}: ca.pem, gateway*.pem, scheduler*.pem, worker*.pem, client*.pem, api-keys.txt, "
          f"redis-password (valid {args.days} days)", file=sys.stderr)
    return 0
