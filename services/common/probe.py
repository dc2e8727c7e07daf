"""`python -m services.common.probe --addr HOST:PORT --service NAME`: one gRPC health check, exit 0 when SERVING.

Kubernetes exec probes use it where the kubelet's own gRPC probe cannot: that one dials in plaintext, so it fails
on a TLS listener and on an mTLS one (no client certificate). The pod's own certificate is its client certificate.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.health import SERVING


def _channel(args: argparse.Namespace) -> grpc.Channel:
    if not args.tls_ca_file:
        return grpc.insecure_channel(args.addr)
    creds = grpc.ssl_channel_credentials(
        root_certificates=Path(args.tls_ca_file).read_bytes(),
        private_key=Path(args.tls_key_file).read_bytes() if args.tls_key_file else None,
        certificate_chain=Path(args.tls_cert_file).read_bytes() if args.tls_cert_file else None,
    )
    # NOTE: the probe dials 127.0.0.1, but the certificate names the Service: verify against that name.
    options = [("grpc.ssl_target_name_override", args.tls_server_name)] if args.tls_server_name else []
    return grpc.secure_channel(args.addr, creds, options=options)


def parse_probe_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m services.common.probe", description=__doc__)
    p.add_argument("--addr", required=True, help="HOST:PORT of the gRPC server")
    p.add_argument("--service", default="", help="health service name (empty: the server overall)")
    p.add_argument("--timeout", type=float, default=4.0, help="seconds")
    p.add_argument("--tls-ca-file", default=None, help="CA that verifies the server (TLS when set)")
    p.add_argument("--tls-cert-file", default=None, help="client certificate (mTLS)")
    p.add_argument("--tls-key-file", default=None, help="client key (mTLS)")
    p.add_argument("--tls-server-name", default=None, help="name to verify in the server certificate")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_probe_args(argv)
    with _channel(args) as channel:
        try:
            resp = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout
            )
        except grpc.RpcError as e:
            print(f"{args.addr} {args.service!r}: {e.code().name}", file=sys.stderr)
            return 1
    if resp.status != SERVING:
        print(f"{args.addr} {args.service!r}: {health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
