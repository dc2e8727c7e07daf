"""grpcurl: the frontend's services are discoverable and callable through server reflection."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from services.launcher import LocalCluster

pytestmark = pytest.mark.slow

GRPCURL = shutil.which("grpcurl") or str(Path(sys.executable).parent / "grpcurl")


def _grpcurl(*args: str) -> str:
    proc = subprocess.run([GRPCURL, "-plaintext", *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_grpcurl_lists_describes_and_generates(cluster: LocalCluster) -> None:
    addr = cluster.frontend_addr
    services = _grpcurl(addr, "list").split()
    assert {"pagoda.v1.Generation", "grpc.health.v1.Health"} <= set(services)
    assert "rpc Generate ( .pagoda.v1.GenerateRequest ) returns ( stream .pagoda.v1.GenerateResponse )" in _grpcurl(
        addr, "describe", "pagoda.v1.Generation"
    )
    body = json.dumps({"text": "The capital of France is", "sampling": {"temperature": 0, "max_tokens": 5}})
    out = _grpcurl("-d", body, addr, "pagoda.v1.Generation/Generate")
    decoder, messages, pos = json.JSONDecoder(), [], 0
    while pos < len(out.strip()):
        msg, end = decoder.raw_decode(out, pos)
        messages.append(msg)
        pos = end + (len(out[end:]) - len(out[end:].lstrip()))
    assert len(messages) >= 2
    assert messages[-1]["final"]["usage"]["completion_tokens"] == 5
    assert "".join(c.get("text", "") for m in messages for c in m.get("choices", []))
    health = json.loads(_grpcurl("-d", '{"service": "pagoda.v1.Generation"}', addr, "grpc.health.v1.Health/Check"))
    assert health["status"] == "SERVING"
