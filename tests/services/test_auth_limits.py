"""Unit checks of the security and limit pieces (no cluster): API keys, limits flags, wire ranges, TLS flags."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine_core.sampling_params import SamplingParams
from services.common.request_scope import check_tenant, scoped_request_id
from services.common.tls import TlsFiles
from services.convert.ranges import INT64_MAX, check_wire_ranges
from services.frontend.auth import ANONYMOUS, ApiKeys, read_keys, tenant_of
from services.frontend.config import parse_frontend_args
from services.frontend.limits import ApiLimits
from services.frontend.request import ErrorCode, RequestError
from services.frontend.slow_clients import DEFAULT_STREAM_SEND_TIMEOUT


def test_open_api_without_keys() -> None:
    assert ApiKeys([]).tenant([]) == ANONYMOUS


@pytest.mark.parametrize(
    "headers",
    [
        [("authorization", "Bearer k1")],
        [("Authorization", "bearer k1")],
        [("x-api-key", "k1")],
        [(b"x", b"y"), ("x-api-key", b"k1")],
    ],
)
def test_key_headers(headers: list[tuple[str, str]]) -> None:
    assert ApiKeys(["k1", "k2"]).tenant(headers) == tenant_of("k1") != tenant_of("k2")


@pytest.mark.parametrize(
    "headers", [[], [("authorization", "k1")], [("x-api-key", "k3")], [("authorization", "Bearer ")]]
)
def test_missing_or_wrong_key(headers: list[tuple[str, str]]) -> None:
    with pytest.raises(RequestError) as info:
        ApiKeys(["k1"]).tenant(headers)
    assert info.value.code is ErrorCode.UNAUTHENTICATED


def test_tenant_never_contains_the_key() -> None:
    assert "secret" not in tenant_of("secret-key")


def test_keys_file_and_inline(tmp_path: Path) -> None:
    f = tmp_path / "keys"
    f.write_text("# comment\nfile-key\n\n")
    assert read_keys("a, b,", str(f)) == ["a", "b", "file-key"]


def test_limit_flags_derive_from_the_dataclass() -> None:
    assert parse_frontend_args([]).limits == ApiLimits()
    assert parse_frontend_args(["--max-n", "3"]).limits.max_n == 3
    with pytest.raises(SystemExit):
        parse_frontend_args(["--max-n", "0"])


def test_frontend_security_defaults() -> None:
    c = parse_frontend_args([])
    assert (c.api_keys, c.enable_client_priority, c.prefix_cache_isolation) == ([], False, "none")
    assert c.drain_timeout == 20.0 and c.tls == TlsFiles()
    with pytest.raises(SystemExit):  # isolation per key needs keys
        parse_frontend_args(["--prefix-cache-isolation", "api-key"])


def test_stream_send_timeout_flag() -> None:
    assert parse_frontend_args([]).stream_send_timeout == DEFAULT_STREAM_SEND_TIMEOUT
    assert parse_frontend_args(["--stream-send-timeout", "2.5"]).stream_send_timeout == 2.5
    for bad in ("0", "-1", "nan"):
        with pytest.raises(SystemExit):
            parse_frontend_args(["--stream-send-timeout", bad])


def test_scoped_request_ids_never_collide_across_tenants() -> None:
    # A tenant never holds the separator, so no (tenant, id) pair can spell another pair's scoped id.
    assert scoped_request_id("key-a", "x") != scoped_request_id("", "key-a/x")
    assert scoped_request_id("", "a/b") != scoped_request_id("a", "b")
    check_tenant(tenant_of("any key"))
    with pytest.raises(ValueError, match="owner"):
        check_tenant("a/b")


WIRE_CASES: list[tuple[dict[str, object], str]] = [
    ({"seed": INT64_MAX, "n": 2}, "seed"),
    ({"max_tokens": 2**31}, "max_tokens"),
    ({"logit_bias": {2**40: 1.0}}, "logit_bias"),
    ({"stop_token_ids": [2**31]}, "stop_token_ids"),
    ({"top_k": 2**31}, "top_k"),
]


@pytest.mark.parametrize(("kwargs", "field"), WIRE_CASES)
def test_wire_ranges_name_the_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field}"):
        check_wire_ranges(SamplingParams(**kwargs))  # type: ignore[arg-type]
    check_wire_ranges(SamplingParams(seed=INT64_MAX - 2, n=3))


def test_limits_name_the_field() -> None:
    limits = ApiLimits(max_stop_strings=1)
    with pytest.raises(RequestError) as info:
        limits.check_params(SamplingParams(stop=["a", "b"]))
    assert info.value.param == "stop"
    assert limits.tracestate("x" * 600) == "" and limits.tracestate("k=v") == "k=v"


def test_tls_flags_must_pair(tmp_path: Path) -> None:
    cert = tmp_path / "c.pem"
    cert.write_text("x")
    with pytest.raises(SystemExit):
        parse_frontend_args(["--tls-cert-file", str(cert)])
    with pytest.raises(SystemExit):
        parse_frontend_args(["--tls-ca-file", str(tmp_path / "missing.pem")])
