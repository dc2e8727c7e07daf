"""Faults injected into a running cluster: clients that disconnect while queued, prefilling and decoding; a worker
SIGKILLed mid-stream and restarted; a worker SIGSTOPped (a hang) busy and idle; the scheduler killed and
restarted. A worker's death costs latency, not requests: the streams it held resume with exactly the tokens of an
undisturbed run; a request in flight at two consecutive failures fails alone; a group not re-formed in time ends
its streams with UNAVAILABLE (retryable). Nothing leaks, and serving resumes by itself."""

from __future__ import annotations

import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from services.client import GenerationClient, text_request
from services.common.health import SERVING, check
from services.launcher import LocalCluster
from services.rpc import GENERATION_SERVICE, SCHEDULER_SERVICE, generation_pb2
from tests.services.probes import all_blocks_free, free_port_pair, print_logs, scrape, start_cluster, wait_until

pytestmark = pytest.mark.slow

MAX_NUM_SEQS = 4
STREAM_TOKENS = 96  # per stream of the load: long enough to be cut mid-stream
GREEDY = text_request("The capital of France is", max_tokens=8)
LONG = "Tell me a very long story about a lighthouse keeper and the sea. " * 30
FAULTS = {"injected": 0, "recovered": 0}
# NOTE: room for a restarted worker to load the model on a busy machine.
REFORM_TIMEOUT_S = 45
# NOTE: the deadline test's own cluster, where nobody restarts the worker in time: any deadline shows the path, and
# the test waits it out, so it is short (the shared cluster's must leave a restarted worker time to load the model).
DEADLINE_REFORM_TIMEOUT_S = 8


def _start_faults_cluster(log_dir: Path, reform_timeout: float) -> LocalCluster:
    return start_cluster(
        log_dir,
        kv_cache_memory=0.25,
        max_num_seqs=MAX_NUM_SEQS,
        metrics_port=free_port_pair(),
        # NOTE: short deadlines so a hang is detected within seconds here (the defaults suit real steps).
        extra_scheduler_args=[
            *["--step-timeout", "4", "--heartbeat-interval", "0.5", "--heartbeat-timeout", "2"],
            *["--worker-reform-timeout", str(reform_timeout)],
        ],
    )


def _stop_faults_cluster(cluster: LocalCluster, log_dir: Path) -> None:
    codes = cluster.stop(timeout=60)
    if codes != {"frontend": 0, "scheduler": 0, "worker0": 0}:
        print_logs(log_dir)
    assert codes == {"frontend": 0, "scheduler": 0, "worker0": 0}, codes


@pytest.fixture(scope="module")
def fcluster(smollm2_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    log_dir = tmp_path_factory.mktemp("faults")
    cluster = _start_faults_cluster(log_dir, REFORM_TIMEOUT_S)
    yield cluster
    print(f"faults: {FAULTS['injected']} injected, {FAULTS['recovered']} recovered")
    _stop_faults_cluster(cluster, log_dir)


@pytest.fixture(scope="module")
def fclient(fcluster: LocalCluster) -> Iterator[GenerationClient]:
    with GenerationClient(fcluster.frontend_addr) as c:
        yield c


@pytest.fixture(scope="module")
def greedy_tokens(fclient: GenerationClient) -> list[int]:
    for _ in range(3):  # NOTE: past the warm-up steps, whose deadline is generous
        tokens = fclient.generate(GREEDY).choices[0].token_ids
    return tokens


@pytest.fixture(scope="module")
def undisturbed(fclient: GenerationClient, greedy_tokens: list[int]) -> list[list[int]]:
    """The tokens of `_load()`'s streams run concurrently with no fault."""
    return _outputs(_start_load(fclient))


class Reader:
    """Consumes one stream on a thread; records its messages and how it ended."""

    def __init__(self, client: GenerationClient, request: generation_pb2.GenerateRequest) -> None:
        self.call = client.stream(request)
        self.messages: list[generation_pb2.GenerateResponse] = []
        self.error: grpc.RpcError | None = None
        self.tokens = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            for msg in self.call:
                self.messages.append(msg)
                if any(c.token_ids for c in msg.choices):
                    self.tokens.set()
        except grpc.RpcError as e:
            self.error = e
        self.tokens.set()

    def join(self, timeout: float) -> None:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the stream did not end"


def _load() -> list[generation_pb2.GenerateRequest]:
    """MAX_NUM_SEQS concurrent streams: greedy ones and a seeded sampled one (its draws must repeat after a resume)."""
    greedy = [text_request(f"{LONG} Chapter {i}.", max_tokens=STREAM_TOKENS, ignore_eos=True) for i in range(3)]
    seeded = text_request(LONG + " A twist.", max_tokens=STREAM_TOKENS, temperature=0.8, seed=1234, ignore_eos=True)
    return [*greedy, seeded]


def _start_load(client: GenerationClient) -> list[Reader]:
    readers = [Reader(client, r) for r in _load()]
    for r in readers:
        assert r.tokens.wait(120)
    return readers


def _tokens(reader: Reader) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for msg in reader.messages:
        for c in msg.choices:
            out.setdefault(c.index, []).extend(c.token_ids)
    return out


def _outputs(readers: list[Reader]) -> list[list[int]]:
    """Each stream's tokens once it ended (it must end without an error)."""
    for r in readers:
        r.join(240)
        assert r.error is None, r.error
    return [_tokens(r)[0] for r in readers]


def _kill_worker(cluster: LocalCluster) -> None:
    worker = cluster.service("worker0").process
    worker.kill()
    worker.wait(30)
    FAULTS["injected"] += 1


def _scheduler_metrics(cluster: LocalCluster) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    return scrape(f"http://127.0.0.1:{cluster.metrics_port('scheduler')}/metrics")


def _by_reason(page: dict[str, dict[tuple[tuple[str, str], ...], float]]) -> dict[str, float]:
    return {dict(k)["reason"]: v for k, v in page["pagoda:worker_resets_total"].items()}


def _serving_again(cluster: LocalCluster, client: GenerationClient, greedy: list[int]) -> None:
    # NOTE: the scheduler first (the frontend mirrors it once a second, so it may not have noticed the outage yet).
    wait_until(lambda: check(cluster.scheduler_addr, SCHEDULER_SERVICE) == SERVING, 180, "scheduler SERVING again")
    wait_until(lambda: check(cluster.frontend_addr, GENERATION_SERVICE) == SERVING, 60, "frontend SERVING again")
    # NOTE: a scheduler back within a second (it loads no torch) can find the frontend's channel still in its
    # reconnect backoff (at most 2 s, reliability.md): requests meanwhile fail with UNAVAILABLE, the retryable
    # status, and a client retries them as this does.
    deadline = time.monotonic() + 30
    while True:
        try:
            tokens = client.generate(GREEDY).choices[0].token_ids
            break
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    assert tokens == greedy
    FAULTS["recovered"] += 1


def test_disconnects_while_queued_prefilling_and_decoding_free_blocks(
    fcluster: LocalCluster, fclient: GenerationClient, greedy_tokens: list[int]
) -> None:
    decoding = [Reader(fclient, text_request(LONG, max_tokens=500, ignore_eos=True)) for _ in range(MAX_NUM_SEQS)]
    for r in decoding:
        assert r.tokens.wait(120)
    queued = Reader(fclient, text_request("Queued behind a full batch.", max_tokens=50))
    wait_until(lambda: bool(queued.messages), 60, "the queued request admitted")
    queued.call.cancel()  # while waiting for a free sequence slot
    for r in decoding:
        r.call.cancel()  # while decoding
    prefill = Reader(fclient, text_request(LONG * 3, max_tokens=5))
    wait_until(lambda: bool(prefill.messages), 60, "the long prompt admitted")
    prefill.call.cancel()  # during its prefill
    for r in [*decoding, queued, prefill]:
        r.join(30)
        assert r.error is not None and r.error.code() == grpc.StatusCode.CANCELLED
    wait_until(lambda: all_blocks_free(fcluster.scheduler_addr), 60, "every block free after the disconnects")


def test_non_streaming_http_disconnect_aborts(fcluster: LocalCluster, greedy_tokens: list[int]) -> None:
    body = b'{"prompt": "Tell me a long story.", "max_tokens": 800, "ignore_eos": true}'
    host, port = "127.0.0.1", fcluster.config.http_port
    head = f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
    with socket.create_connection((host, port)) as sock:
        sock.sendall(head.encode() + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        wait_until(lambda: not all_blocks_free(fcluster.scheduler_addr), 60, "the request running")
    # The client is gone: the request is aborted, not run to 800 tokens with nobody reading.
    wait_until(lambda: all_blocks_free(fcluster.scheduler_addr), 30, "the request aborted after the disconnect")


def test_request_id_reused_right_after_a_cancel_runs_normally(
    fcluster: LocalCluster, fclient: GenerationClient, greedy_tokens: list[int]
) -> None:
    """The old request's abort (and its late events) must never reach the new request with the same id."""
    for i in range(5):
        old = text_request(LONG, max_tokens=300, ignore_eos=True)
        old.request_id = f"reused-{i}"
        reader = Reader(fclient, old)
        assert reader.tokens.wait(120)
        reader.call.cancel()
        new = text_request("Count to ten:", max_tokens=6, ignore_eos=True)
        new.request_id = f"reused-{i}"
        result = None
        for _ in range(100):  # the frontend frees the id as soon as the old stream's cancellation is processed
            try:
                result = fclient.generate(new)
                break
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.ALREADY_EXISTS, e
                time.sleep(0.05)
        assert result is not None, "the id never became free"
        assert [c.finish_reason for c in result.choices] == ["FINISH_REASON_LENGTH"]
        assert len(result.choices[0].token_ids) == 6
        reader.join(30)
    wait_until(lambda: all_blocks_free(fcluster.scheduler_addr), 30, "every block free")


def test_sigstop_worker_mid_stream_is_a_hang_the_streams_resume_after(
    fcluster: LocalCluster, fclient: GenerationClient, undisturbed: list[list[int]]
) -> None:
    before = _by_reason(_scheduler_metrics(fcluster))["step_deadline"]
    readers = _start_load(fclient)
    worker = fcluster.service("worker0").process
    worker.send_signal(signal.SIGSTOP)
    FAULTS["injected"] += 1
    try:
        # The step deadline (4 s + per token) notices the hang; the group re-forms once the worker answers again.
        wait_until(
            lambda: _by_reason(_scheduler_metrics(fcluster))["step_deadline"] > before, 60, "the deadline missed"
        )
    finally:
        worker.send_signal(signal.SIGCONT)
    assert _outputs(readers) == undisturbed
    page = _scheduler_metrics(fcluster)
    assert sum(page["pagoda:step_deadline_misses_total"].values()) == _by_reason(page)["step_deadline"]
    assert sum(page["pagoda:failover_resumed_requests_total"].values()) >= 1
    FAULTS["recovered"] += 1
    wait_until(lambda: all_blocks_free(fcluster.scheduler_addr), 30, "every block free after the hang")


def test_sigstop_idle_worker_is_noticed_by_the_heartbeat(
    fcluster: LocalCluster, fclient: GenerationClient, greedy_tokens: list[int]
) -> None:
    worker = fcluster.service("worker0").process
    worker.send_signal(signal.SIGSTOP)
    FAULTS["injected"] += 1
    try:
        wait_until(lambda: check(fcluster.frontend_addr, GENERATION_SERVICE) != SERVING, 30, "frontend NOT_SERVING")
        with pytest.raises(grpc.RpcError) as info:
            list(fclient.stub.Generate(GREEDY, timeout=30))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE  # fails fast, retryable
    finally:
        worker.send_signal(signal.SIGCONT)
    _serving_again(fcluster, fclient, greedy_tokens)
    assert _by_reason(_scheduler_metrics(fcluster))["heartbeat"] >= 1


def test_sigkill_worker_mid_stream_every_stream_completes_as_undisturbed(
    fcluster: LocalCluster, fclient: GenerationClient, undisturbed: list[list[int]]
) -> None:
    readers = _start_load(fclient)
    _kill_worker(fcluster)
    fcluster.restart("worker0")  # what `pagoda serve` (services/supervisor.py) or Kubernetes does
    # Greedy and seeded streams alike: every token once, none lost, the same as without the fault.
    assert _outputs(readers) == undisturbed
    assert sum(_scheduler_metrics(fcluster)["pagoda:failover_resumed_requests_total"].values()) >= len(readers)
    FAULTS["recovered"] += 1
    wait_until(lambda: all_blocks_free(fcluster.scheduler_addr), 30, "every block free after the restart")


def test_a_request_in_flight_at_two_consecutive_failures_fails_alone(
    fcluster: LocalCluster, fclient: GenerationClient, undisturbed: list[list[int]]
) -> None:
    poison = Reader(fclient, text_request(LONG, max_tokens=1000, ignore_eos=True))
    assert poison.tokens.wait(120)
    _kill_worker(fcluster)
    fcluster.restart("worker0")
    seen = len(poison.messages)
    wait_until(lambda: len(poison.messages) > seen, 180, "the first victim resumed")
    assert poison.error is None
    bystander = Reader(fclient, _load()[0])  # arrives between the failures: in flight at the second only
    assert bystander.tokens.wait(120)
    _kill_worker(fcluster)
    fcluster.restart("worker0")
    poison.join(180)
    assert poison.error is not None and poison.error.code() == grpc.StatusCode.UNAVAILABLE, poison.error
    assert "in flight at 2 worker group failures" in (poison.error.details() or "")
    bystander.join(180)
    assert bystander.error is None, bystander.error
    assert _tokens(bystander)[0] == undisturbed[0]
    assert sum(_scheduler_metrics(fcluster)["pagoda:failover_poison_requests_total"].values()) >= 1
    FAULTS["recovered"] += 1
    wait_until(lambda: all_blocks_free(fcluster.scheduler_addr), 30, "every block free after the poison request")


def test_group_not_reformed_in_time_ends_the_streams_unavailable(
    smollm2_dir: str, tmp_path_factory: pytest.TempPathFactory, greedy_tokens: list[int]
) -> None:
    log_dir = tmp_path_factory.mktemp("faults-deadline")
    cluster = _start_faults_cluster(log_dir, DEADLINE_REFORM_TIMEOUT_S)
    try:
        with GenerationClient(cluster.frontend_addr) as client:
            _not_reformed_in_time(cluster, client, greedy_tokens)
    finally:
        _stop_faults_cluster(cluster, log_dir)


def _not_reformed_in_time(cluster: LocalCluster, client: GenerationClient, greedy_tokens: list[int]) -> None:
    reader = Reader(client, text_request(LONG, max_tokens=500, ignore_eos=True))
    assert reader.tokens.wait(120)
    _kill_worker(cluster)  # and nobody restarts it in time
    reader.join(DEADLINE_REFORM_TIMEOUT_S + 60)
    assert reader.error is not None and reader.error.code() == grpc.StatusCode.UNAVAILABLE, reader.error
    assert f"not re-formed within {DEADLINE_REFORM_TIMEOUT_S} s" in (reader.error.details() or ""), reader.error
    # While the worker is down, new requests fail fast with UNAVAILABLE (retry elsewhere / later).
    wait_until(lambda: check(cluster.frontend_addr, GENERATION_SERVICE) != SERVING, 30, "frontend NOT_SERVING")
    with pytest.raises(grpc.RpcError) as info:
        list(client.stub.Generate(GREEDY, timeout=30))
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    cluster.restart("worker0")  # the scheduler kept trying: it re-forms for the requests to come
    _serving_again(cluster, client, greedy_tokens)
    wait_until(lambda: all_blocks_free(cluster.scheduler_addr), 30, "every block free after the restart")


def test_scheduler_killed_frontend_fails_fast_and_reconnects(
    fcluster: LocalCluster, fclient: GenerationClient, greedy_tokens: list[int]
) -> None:
    reader = Reader(fclient, text_request(LONG, max_tokens=500, ignore_eos=True))
    assert reader.tokens.wait(120)
    scheduler = fcluster.service("scheduler").process
    scheduler.kill()
    scheduler.wait(30)
    FAULTS["injected"] += 1
    reader.join(30)
    assert reader.error is not None and reader.error.code() == grpc.StatusCode.UNAVAILABLE, reader.error
    with pytest.raises(grpc.RpcError) as info:
        list(fclient.stub.Generate(GREEDY, timeout=30))
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE  # not DEADLINE_EXCEEDED: it did not wait
    fcluster.restart("scheduler")
    _serving_again(fcluster, fclient, greedy_tokens)
