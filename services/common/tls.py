"""TLS for every gRPC hop, from the shared flags `--tls-cert-file`, `--tls-key-file`, `--tls-ca-file`.

The cert/key pair is this process's identity: the server certificate of its listener and the client certificate of
its outbound hop. The CA verifies the peer it calls; on an internal service (scheduler, worker) a CA given together
with the cert also makes the listener require and verify client certificates (mTLS between services). Without any
of the flags every hop stays plaintext, as before (loopback-only by default for internal services).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import grpc

from services.common.flags import add_flag, optional_str


@dataclass(frozen=True)
class TlsFiles:
    cert_file: str | None = None
    key_file: str | None = None
    ca_file: str | None = None

    @staticmethod
    def add_flags(parser: argparse.ArgumentParser) -> None:
        add_flag(parser, "--tls-cert-file", default=None, type=optional_str, help="PEM certificate of this process")
        add_flag(parser, "--tls-key-file", default=None, type=optional_str, help="PEM private key of the certificate")
        add_flag(parser, "--tls-ca-file", default=None, type=optional_str, help="PEM CA that verifies the peer hop")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> TlsFiles:
        files = cls(args.tls_cert_file, args.tls_key_file, args.tls_ca_file)
        if (files.cert_file is None) != (files.key_file is None):
            raise ValueError("--tls-cert-file and --tls-key-file go together")
        for path in (files.cert_file, files.key_file, files.ca_file):
            if path is not None and not Path(path).is_file():
                raise ValueError(f"TLS file {path} does not exist")
        return files

    @property
    def client_enabled(self) -> bool:
        return self.ca_file is not None or self.cert_file is not None

    def server_credentials(self, require_client_cert: bool) -> grpc.ServerCredentials | None:
        """None: plaintext. `require_client_cert` (internal services) takes effect only with a CA to verify."""
        if self.cert_file is None or self.key_file is None:
            return None
        pair = (Path(self.key_file).read_bytes(), Path(self.cert_file).read_bytes())
        ca = Path(self.ca_file).read_bytes() if self.ca_file and require_client_cert else None
        return grpc.ssl_server_credentials([pair], root_certificates=ca, require_client_auth=ca is not None)

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        """None: plaintext. The CA verifies the server; the cert/key pair is presented as a client certificate."""
        if not self.client_enabled:
            return None
        return grpc.ssl_channel_credentials(
            root_certificates=Path(self.ca_file).read_bytes() if self.ca_file else None,
            private_key=Path(self.key_file).read_bytes() if self.key_file else None,
            certificate_chain=Path(self.cert_file).read_bytes() if self.cert_file else None,
        )


def add_port(server: grpc.aio.Server, addr: str, tls: TlsFiles, require_client_cert: bool) -> int:
    creds = tls.server_credentials(require_client_cert)
    return server.add_secure_port(addr, creds) if creds is not None else server.add_insecure_port(addr)


def sync_channel(addr: str, tls: TlsFiles, options: list[tuple[str, int]]) -> grpc.Channel:
    creds = tls.channel_credentials()
    if creds is None:
        return grpc.insecure_channel(addr, options=options)
    return grpc.secure_channel(addr, creds, options=options)


def aio_channel(
    addr: str,
    tls: TlsFiles,
    options: list[tuple[str, int | str]],
    interceptors: list[grpc.aio.ClientInterceptor] | None = None,
) -> grpc.aio.Channel:
    creds = tls.channel_credentials()
    if creds is None:
        return grpc.aio.insecure_channel(addr, options=options, interceptors=interceptors)
    return grpc.aio.secure_channel(addr, creds, options=options, interceptors=interceptors)
