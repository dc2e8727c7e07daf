"""The exec health probe: SERVING -> 0, anything else -> 1, in plaintext and against an mTLS listener."""

from __future__ import annotations

import asyncio
import datetime
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from services.common.health import LIVENESS_SERVICE, ServiceHealth
from services.common.probe import main as probe

SERVER_NAME = "pagoda-scheduler.ns.svc.cluster.local"


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    fmt = serialization.PrivateFormat.PKCS8
    return key.private_bytes(serialization.Encoding.PEM, fmt, serialization.NoEncryption())


def _cert(subject: str, key, issuer: str, issuer_key, *, ca: bool, san: str | None = None) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    b = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
        .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if san:
        b = b.add_extension(x509.SubjectAlternativeName([x509.DNSName(san)]), critical=False)
    return b.sign(issuer_key, hashes.SHA256())


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("pki")
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = _cert("test-ca", ca_key, "test-ca", ca_key, ca=True)
    key = ec.generate_private_key(ec.SECP256R1())
    cert = _cert(SERVER_NAME, key, "test-ca", ca_key, ca=False, san=SERVER_NAME)
    (d / "ca.crt").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    (d / "tls.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (d / "tls.key").write_bytes(_pem_key(key))
    return d


def _serve(credentials: grpc.ServerCredentials | None) -> Iterator[str]:
    """A health server on its own event loop thread, liveness SERVING and readiness NOT_SERVING."""
    loop = asyncio.new_event_loop()
    started: list[int] = []
    ready = threading.Event()
    stop: asyncio.Event | None = None

    async def run() -> None:
        nonlocal stop
        stop = asyncio.Event()
        server = grpc.aio.server()
        health = ServiceHealth(server, ["pagoda.v1.Example"])
        await health.set_serving(False)
        if credentials is None:
            started.append(server.add_insecure_port("127.0.0.1:0"))
        else:
            started.append(server.add_secure_port("127.0.0.1:0", credentials))
        await server.start()
        ready.set()
        await stop.wait()
        await server.stop(None)

    thread = threading.Thread(target=loop.run_until_complete, args=(run(),))
    thread.start()
    assert ready.wait(10)
    try:
        yield f"127.0.0.1:{started[0]}"
    finally:
        loop.call_soon_threadsafe(stop.set)  # type: ignore[union-attr]
        thread.join(10)
        loop.close()


@pytest.fixture
def plain_addr() -> Iterator[str]:
    yield from _serve(None)


@pytest.fixture
def mtls_addr(pki: Path) -> Iterator[str]:
    creds = grpc.ssl_server_credentials(
        [((pki / "tls.key").read_bytes(), (pki / "tls.crt").read_bytes())],
        root_certificates=(pki / "ca.crt").read_bytes(),
        require_client_auth=True,
    )
    yield from _serve(creds)


def test_plaintext(plain_addr: str) -> None:
    assert probe(["--addr", plain_addr, "--service", LIVENESS_SERVICE]) == 0
    assert probe(["--addr", plain_addr, "--service", "pagoda.v1.Example"]) == 1  # NOT_SERVING
    assert probe(["--addr", plain_addr, "--service", "pagoda.v1.Unknown"]) == 1  # NOT_FOUND
    assert probe(["--addr", "127.0.0.1:1", "--timeout", "0.5"]) == 1  # nothing listening


def test_mtls(mtls_addr: str, pki: Path) -> None:
    tls = ["--tls-ca-file", str(pki / "ca.crt"), "--tls-server-name", SERVER_NAME]
    client = ["--tls-cert-file", str(pki / "tls.crt"), "--tls-key-file", str(pki / "tls.key")]
    assert probe(["--addr", mtls_addr, "--service", LIVENESS_SERVICE, *tls, *client]) == 0
    # Without a client certificate the mTLS listener refuses the handshake; in plaintext too.
    assert probe(["--addr", mtls_addr, "--service", LIVENESS_SERVICE, "--timeout", "2", *tls]) == 1
    assert probe(["--addr", mtls_addr, "--service", LIVENESS_SERVICE, "--timeout", "2"]) == 1
