"""Nothing open by default: internal ports on loopback, API keys on the public APIs, Abort only by the submitting
key, per-key prefix-cache isolation, TLS on every hop (a test CA made here). One TLS + API-key cluster."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import requests

from services.client import text_request
from services.common.grpc_opts import CHANNEL_OPTIONS
from services.frontend.config import parse_frontend_args
from services.launcher import LaunchConfig, LocalCluster, free_port
from services.rpc import (
    GENERATION_SERVICE,
    common_pb2,
    generation_pb2,
    generation_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
)
from services.scheduler.config import parse_scheduler_args
from services.worker.config import parse_worker_args
from tests.services.certs import make_test_pki
from tests.services.probes import start_healthy, wait_until

pytestmark = pytest.mark.slow

KEY_A, KEY_B = "key-alpha-0123456789", "key-bravo-9876543210"


@pytest.fixture(scope="module")
def secure_cluster(smollm2_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    tmp = tmp_path_factory.mktemp("security")
    tls = make_test_pki(tmp / "pki")
    keys_file = tmp / "keys.txt"
    keys_file.write_text(f"# tenants\n{KEY_B}\n")
    config = LaunchConfig.on_loopback(
        kv_cache_memory=0.25,
        num_threads=1,
        max_num_seqs=16,
        log_dir=str(tmp / "logs"),
        tls=tls,
        extra_frontend_args=[
            *("--api-keys", KEY_A, "--api-keys-file", str(keys_file)),
            *("--prefix-cache-isolation", "api-key"),
        ],
    )
    cluster = start_healthy(config)
    yield cluster
    assert cluster.stop(timeout=60) == {"frontend": 0, "scheduler": 0, "worker0": 0}


@pytest.fixture(scope="module")
def stub(secure_cluster: LocalCluster) -> Iterator[generation_pb2_grpc.GenerationStub]:
    tls = secure_cluster.config.tls
    assert tls.ca_file is not None
    creds = grpc.ssl_channel_credentials(root_certificates=Path(tls.ca_file).read_bytes())
    with grpc.secure_channel(secure_cluster.frontend_addr, creds, options=CHANNEL_OPTIONS) as channel:
        yield generation_pb2_grpc.GenerationStub(channel)


def _key(key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


def _listening(port: int) -> list[str]:
    """Local addresses (hex, as /proc/net/tcp* writes them) listening on `port`."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not Path(table).exists():
            continue
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            addr, hex_port = local.rsplit(":", 1)
            if state == "0A" and int(hex_port, 16) == port:
                found.append(addr)
    return found


def test_internal_services_bind_loopback_by_default(secure_cluster: LocalCluster) -> None:
    assert parse_scheduler_args([]).host == "127.0.0.1"
    assert parse_worker_args([]).host == "127.0.0.1"
    assert parse_frontend_args([]).host == "0.0.0.0"  # the public service
    # 127.0.0.1, ::1, ::ffff:127.0.0.1 (gRPC binds a dual-stack socket)
    loopback = {"0100007F", "00000000000000000000000001000000", "0000000000000000FFFF00000100007F"}
    for port in (secure_cluster.config.scheduler_port, *secure_cluster.config.worker_ports):
        bound = _listening(port)
        assert bound and set(bound) <= loopback, (port, bound)


def test_tls_round_trip_and_plaintext_refused(
    secure_cluster: LocalCluster, stub: generation_pb2_grpc.GenerationStub
) -> None:
    # A full generation: client -TLS-> frontend -mTLS-> scheduler -mTLS-> worker.
    msgs = list(stub.Generate(text_request("The capital of France is", max_tokens=4), metadata=_key(KEY_A)))
    assert msgs[-1].final.usage.completion_tokens == 4
    with grpc.insecure_channel(secure_cluster.frontend_addr) as plain:
        with pytest.raises(grpc.RpcError) as info:
            generation_pb2_grpc.GenerationStub(plain).ModelInfo(generation_pb2.ModelInfoRequest(), timeout=5)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    # The scheduler requires a client certificate signed by the CA: TLS alone (no client cert) is refused.
    tls = secure_cluster.config.tls
    assert tls.ca_file is not None
    creds = grpc.ssl_channel_credentials(root_certificates=Path(tls.ca_file).read_bytes())
    with grpc.secure_channel(secure_cluster.scheduler_addr, creds) as channel:
        with pytest.raises(grpc.RpcError) as info:
            scheduler_pb2_grpc.SchedulerStub(channel).Stats(scheduler_pb2.StatsRequest(), timeout=5)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize("metadata", [(), _key("wrong"), (("x-api-key", "wrong"),), (("authorization", KEY_A),)])
def test_wrong_or_missing_key_is_unauthenticated(
    stub: generation_pb2_grpc.GenerationStub, metadata: tuple[tuple[str, str], ...]
) -> None:
    for call in (
        lambda: list(stub.Generate(text_request("Hi", max_tokens=2), metadata=metadata)),
        lambda: stub.ModelInfo(generation_pb2.ModelInfoRequest(), metadata=metadata, timeout=5),
        lambda: stub.Abort(common_pb2.AbortRequest(request_id="x"), metadata=metadata, timeout=5),
    ):
        with pytest.raises(grpc.RpcError) as info:
            call()
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_both_key_headers_and_key_file_work(stub: generation_pb2_grpc.GenerationStub) -> None:
    assert stub.ModelInfo(generation_pb2.ModelInfoRequest(), metadata=(("x-api-key", KEY_B),), timeout=5).model
    assert stub.ModelInfo(generation_pb2.ModelInfoRequest(), metadata=_key(KEY_A), timeout=5).model


def test_http_wrong_key_is_401_and_right_key_serves(secure_cluster: LocalCluster) -> None:
    url = secure_cluster.http_url.replace("http://", "https://")
    ca = secure_cluster.config.tls.ca_file
    body = {"prompt": "Hello", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer nope"}, {"x-api-key": "nope"}):
        r = requests.post(f"{url}/v1/completions", json=body, headers=headers, verify=ca, timeout=30)
        assert r.status_code == 401, r.text
        assert requests.get(f"{url}/v1/models", headers=headers, verify=ca, timeout=30).status_code == 401
    r = requests.post(f"{url}/v1/completions", json=body, headers={"x-api-key": KEY_B}, verify=ca, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2
    assert requests.get(f"{url}/health", verify=ca, timeout=30).status_code == 200  # probes need no key


def test_abort_only_by_the_submitting_key(stub: generation_pb2_grpc.GenerationStub) -> None:
    request = text_request("Tell me a long story about the sea.", max_tokens=400, ignore_eos=True)
    request.request_id = "tenant-a-request"
    call = stub.Generate(request, metadata=_key(KEY_A))
    messages: list[generation_pb2.GenerateResponse] = []
    first = threading.Event()

    def read() -> None:
        for m in call:
            messages.append(m)
            first.set()

    reader = threading.Thread(target=read)
    reader.start()
    assert first.wait(60)
    other = stub.Abort(common_pb2.AbortRequest(request_id="tenant-a-request", owner=""), metadata=_key(KEY_B))
    assert not other.found  # as if it did not exist
    assert stub.Abort(common_pb2.AbortRequest(request_id="tenant-a-request"), metadata=_key(KEY_A)).found
    reader.join(60)
    assert not reader.is_alive()
    final = messages[-1].final
    assert final.choices[0].finish_reason == common_pb2.FINISH_REASON_ABORT
    assert final.usage.completion_tokens < 400


def _cached(stub: generation_pb2_grpc.GenerationStub, key: str, prompt: str) -> int:
    msgs = list(stub.Generate(text_request(prompt, max_tokens=1), metadata=_key(key)))
    return msgs[-1].final.usage.cached_prompt_tokens


def test_prefix_cache_is_isolated_per_key(stub: generation_pb2_grpc.GenerationStub) -> None:
    prompt = "A shared system prompt that is long enough to fill several KV blocks of sixteen tokens. " * 4
    assert _cached(stub, KEY_A, prompt) == 0
    assert _cached(stub, KEY_A, prompt) > 0  # the same tenant hits its own entries
    assert _cached(stub, KEY_B, prompt) == 0  # another tenant never sees them


def _story(request_id: str, max_tokens: int = 200) -> generation_pb2.GenerateRequest:
    request = text_request("Tell me a long story about the sea.", max_tokens=max_tokens, ignore_eos=True)
    request.request_id = request_id
    return request


def _finish(
    first: generation_pb2.GenerateResponse, rest: Iterator[generation_pb2.GenerateResponse]
) -> list[generation_pb2.GenerateResponse]:
    messages = [first, *rest]
    assert {m.request_id for m in messages} == {first.request_id}  # the id the client sent, on every message
    return messages


def test_request_ids_are_scoped_by_key(stub: generation_pb2_grpc.GenerationStub) -> None:
    # Both keys use the same id at once: two requests, both served in full.
    calls = {key: stub.Generate(_story("shared-id"), metadata=_key(key)) for key in (KEY_A, KEY_B)}
    firsts = {key: next(call) for key, call in calls.items()}
    # The same key reusing its in-flight id is still refused.
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(_story("shared-id"), metadata=_key(KEY_A)))
    assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS
    for key, call in calls.items():
        messages = _finish(firsts[key], call)
        assert messages[0].request_id == "shared-id"
        final = messages[-1].final
        assert final.choices[0].finish_reason == common_pb2.FINISH_REASON_LENGTH, key
        assert final.usage.completion_tokens == 200


def test_abort_of_another_keys_id_is_not_found_and_leaves_it_running(
    stub: generation_pb2_grpc.GenerationStub,
) -> None:
    a = stub.Generate(_story("a-alone", max_tokens=120), metadata=_key(KEY_A))
    a_first = next(a)
    assert not stub.Abort(common_pb2.AbortRequest(request_id="a-alone"), metadata=_key(KEY_B), timeout=10).found
    # Both keys run "both"; B aborts its own: A's request of that id runs on untouched.
    a_both = stub.Generate(_story("both", max_tokens=120), metadata=_key(KEY_A))
    b_both = stub.Generate(_story("both", max_tokens=2000), metadata=_key(KEY_B))
    a_both_first, b_both_first = next(a_both), next(b_both)
    assert stub.Abort(common_pb2.AbortRequest(request_id="both"), metadata=_key(KEY_B), timeout=10).found
    b_final = _finish(b_both_first, b_both)[-1].final
    assert b_final.choices[0].finish_reason == common_pb2.FINISH_REASON_ABORT
    assert b_final.usage.completion_tokens < 2000
    for first, call in ((a_first, a), (a_both_first, a_both)):
        final = _finish(first, call)[-1].final
        assert final.choices[0].finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert final.usage.completion_tokens == 120


def test_http_request_ids_are_scoped_by_key(secure_cluster: LocalCluster) -> None:
    url = secure_cluster.http_url.replace("http://", "https://") + "/v1/completions"
    ca = secure_cluster.config.tls.ca_file
    body = {"prompt": "Tell me a long story.", "max_tokens": 200, "ignore_eos": True, "stream": True}

    def post(key: str) -> requests.Response:
        headers = {"x-api-key": key, "x-request-id": "http-shared"}
        return requests.post(url, json=body, headers=headers, verify=ca, stream=True, timeout=120)

    streams = [post(KEY_A), post(KEY_B)]  # both admitted: 200 is answered once the scheduler took the request
    assert [r.status_code for r in streams] == [200, 200]
    again = post(KEY_A)
    assert again.status_code == 409, again.text
    assert again.json()["error"]["param"] == "request_id"
    for r in streams:
        lines = [line for line in r.iter_lines(decode_unicode=True) if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        assert '"id":"cmpl-http-shared"' in lines[0]


def _serving(stub: generation_pb2_grpc.GenerationStub) -> bool:
    try:
        return bool(stub.ModelInfo(generation_pb2.ModelInfoRequest(), metadata=_key(KEY_A), timeout=5).model)
    except grpc.RpcError:
        return False


def test_request_ids_are_scoped_across_frontends(
    secure_cluster: LocalCluster, stub: generation_pb2_grpc.GenerationStub
) -> None:
    """A second frontend on the same scheduler: each frontend only knows its own streams, the scheduler keys them
    by (tenant, id)."""
    port = free_port()
    args = ["--host", "127.0.0.1", "--grpc-port", str(port), "--http-port", "-1"]
    args += ["--scheduler-addr", secure_cluster.scheduler_addr, *secure_cluster.config.extra_frontend_args]
    second = secure_cluster.spawn("frontend2", "services.frontend", args, f"127.0.0.1:{port}", GENERATION_SERVICE, {})
    tls = secure_cluster.config.tls
    assert tls.ca_file is not None
    creds = grpc.ssl_channel_credentials(root_certificates=Path(tls.ca_file).read_bytes())
    try:
        with grpc.secure_channel(f"127.0.0.1:{port}", creds, options=CHANNEL_OPTIONS) as channel:
            stub2 = generation_pb2_grpc.GenerationStub(channel)
            wait_until(lambda: _serving(stub2), 300, "the second frontend serving")
            a = stub.Generate(_story("across", max_tokens=2000), metadata=_key(KEY_A))
            b = stub2.Generate(_story("across", max_tokens=120), metadata=_key(KEY_B))
            a_first, b_first = next(a), next(b)  # the same id, two keys, two frontends: both run
            # The same key through the other frontend: only the scheduler knows the id is taken.
            with pytest.raises(grpc.RpcError) as info:
                list(stub2.Generate(_story("across", max_tokens=4), metadata=_key(KEY_A)))
            assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS
            # A aborts its own request through the other frontend; B's request of that id runs on untouched.
            assert stub2.Abort(common_pb2.AbortRequest(request_id="across"), metadata=_key(KEY_A), timeout=10).found
            assert _finish(a_first, a)[-1].final.choices[0].finish_reason == common_pb2.FINISH_REASON_ABORT
            b_final = _finish(b_first, b)[-1].final
            assert b_final.choices[0].finish_reason == common_pb2.FINISH_REASON_LENGTH
            assert b_final.usage.completion_tokens == 120
    finally:
        second.process.terminate()
        assert second.process.wait(60) == 0
        secure_cluster.services.remove(second)
