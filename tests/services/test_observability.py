"""Tracing, metrics and logs of the three real services, started as a user would: only OTEL_* variables point them
at an OTLP/gRPC receiver inside this test (plus `--collect-detailed-traces`). A small KV pool forces preemptions."""

from __future__ import annotations

import json
import queue
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from opentelemetry.proto.trace.v1.trace_pb2 import Status

from services.client import GenerationClient, text_request
from services.common.health import check
from services.launcher import LaunchConfig, LocalCluster
from services.rpc import common_pb2, scheduler_pb2
from services.scheduler.tracing import SUBMIT_SPAN
from tests.services.otlp_receiver import OtlpReceiver, ReceivedSpan
from tests.services.probes import free_port_pair, scrape, start_healthy

pytestmark = pytest.mark.slow

NUM_KV_BLOCKS = 12  # x 16 tokens: two requests of ~150 tokens each cannot both keep their blocks
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN_ID = "00f067aa0ba902b7"
STATUS_CODE_ERROR = Status.STATUS_CODE_ERROR
SERVICES = {"frontend": "pagoda-frontend", "scheduler": "pagoda-scheduler", "worker": "pagoda-worker"}


@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as r:
        yield r


@pytest.fixture(scope="module")
def traced(
    smollm2_dir: str, receiver: OtlpReceiver, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalCluster]:
    log_dir = tmp_path_factory.mktemp("traced-logs")
    config = LaunchConfig.on_loopback(
        dtype="float32",
        kv_cache_memory=0.5,
        num_threads=1,
        max_num_seqs=8,
        log_dir=str(log_dir),
        metrics_port=free_port_pair(),
        collect_detailed_traces=True,
        extra_scheduler_args=["--num-kv-blocks", str(NUM_KV_BLOCKS)],
        # NOTE: a short export delay so the test does not wait 5 s for each batch of spans.
        env={"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "100"},
    )
    c = start_healthy(config)
    yield c
    codes = c.stop(timeout=60)
    assert codes == {"frontend": 0, "scheduler": 0, "worker0": 0}, codes


def _total(page: dict[str, dict[tuple[tuple[str, str], ...], float]], name: str, **labels: str) -> float:
    return sum(v for k, v in page.get(name, {}).items() if all((key, val) in k for key, val in labels.items()))


def _generate_traced(c: LocalCluster, trace_id: str, max_tokens: int = 6, **sampling: object) -> str:
    with GenerationClient(c.frontend_addr) as client:
        request = text_request("The capital of France is", max_tokens=max_tokens, **sampling)
        request.request_id = f"obs-{trace_id[:8]}"
        metadata = (("traceparent", f"00-{trace_id}-{CLIENT_SPAN_ID}-01"),)
        msgs = list(client.stream(request, metadata))
    assert msgs[-1].HasField("final")
    return request.request_id


def _children(spans: list[ReceivedSpan], parent: ReceivedSpan) -> list[ReceivedSpan]:
    return [s for s in spans if s.parent_span_id == parent.span_id]


def test_one_generate_is_one_connected_trace_across_three_processes(
    traced: LocalCluster, receiver: OtlpReceiver
) -> None:
    rid = _generate_traced(traced, TRACE_ID)

    def complete(spans: list[ReceivedSpan]) -> bool:
        mine = [s for s in spans if s.trace_id == TRACE_ID]
        names = {s.name for s in mine}
        ids = {s.span_id for s in mine}
        connected = len([s for s in mine if s.parent_span_id not in ids]) == 1
        return connected and {"Execute", "forward", "decode", "/pagoda.v1.Generation/Generate"} <= names

    spans = [s for s in receiver.wait_for(complete) if s.trace_id == TRACE_ID]
    assert {s.service for s in spans} == set(SERVICES.values())
    # a connected tree: one root, the child of the client's span; every other parent is in the trace
    ids = {s.span_id for s in spans}
    roots = [s for s in spans if s.parent_span_id not in ids]
    assert [(r.name, r.parent_span_id) for r in roots] == [("/pagoda.v1.Generation/Generate", CLIENT_SPAN_ID)]

    by_name = {s.name: s for s in spans}
    server = by_name["/pagoda.v1.Generation/Generate"]
    (gen,) = [s for s in _children(spans, server) if s.name.startswith("text_completion ")]
    assert gen.name == "text_completion SmolLM2-135M-Instruct"
    a = gen.attributes
    assert a["gen_ai.operation.name"] == "text_completion" and a["gen_ai.provider.name"] == "pagoda"
    assert a["gen_ai.request.model"] == "SmolLM2-135M-Instruct" and a["gen_ai.request.max_tokens"] == 6
    assert a["gen_ai.response.id"] == rid and a["gen_ai.response.finish_reasons"] == ["length"]
    assert a["gen_ai.usage.output_tokens"] == 6 and a["gen_ai.usage.input_tokens"] > 0
    assert "gen_ai.usage.cache_read.input_tokens" in a
    assert {c.name for c in _children(spans, gen)} >= {"tokenize", "detokenize", "/pagoda.v1.Scheduler/Submit"}

    # the scheduler's span is the child of the frontend's call, not of the client's header
    client_call = next(c for c in _children(spans, gen) if c.name == "/pagoda.v1.Scheduler/Submit")
    (submit,) = [s for s in _children(spans, client_call) if s.service == SERVICES["scheduler"]]
    assert {c.name for c in _children(spans, submit)} >= {"queue", "prefill", "decode"}
    sa = submit.attributes
    for key in ("time_in_queue", "time_to_first_token", "e2e", "time_in_model_prefill", "time_in_model_decode"):
        assert sa[f"gen_ai.latency.{key}"] >= 0
    assert sa["pagoda.request.num_steps"] >= 6 and sa["pagoda.request.num_preemptions"] == 0
    assert "pagoda.prefix_cache.hit_tokens" in sa

    # detailed: the engine's steps link to the request; the worker's Execute is a step's child
    steps = [s for s in spans if s.name == "step"]
    assert steps and all((TRACE_ID, submit.span_id) in s.links for s in steps)
    assert all(s.parent_span_id == submit.span_id for s in steps)
    executes = [s for s in spans if s.name == "Execute"]
    assert executes and all(s.service == SERVICES["worker"] for s in executes)
    assert {e.parent_span_id for e in executes} <= {s.span_id for s in steps}
    assert {c.name for c in _children(spans, executes[0])} == {"prepare_inputs", "forward", "sample"}


def test_preemption_shows_as_events(traced: LocalCluster, receiver: OtlpReceiver) -> None:
    trace_ids = [f"{i:02d}" + "a" * 30 for i in range(2)]
    threads = [
        threading.Thread(target=_generate_traced, args=(traced, t), kwargs={"max_tokens": 140, "ignore_eos": True})
        for t in trace_ids
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    def submits(spans: list[ReceivedSpan]) -> list[ReceivedSpan]:
        return [s for s in spans if s.trace_id in trace_ids and s.name == "/pagoda.v1.Scheduler/Submit" and s.kind == 2]

    spans = receiver.wait_for(lambda s: len(submits(s)) == 2)
    events = [e for s in submits(spans) for e in s.events]
    names = [e[0] for e in events]
    assert "preempted" in names and names.count("preempted") == names.count("resumed")
    assert sum(s.attributes["pagoda.request.num_preemptions"] for s in submits(spans)) == names.count("preempted")


def test_http_request_is_traced(traced: LocalCluster, receiver: OtlpReceiver) -> None:
    trace_id = "b" * 32
    body = json.dumps({"model": "SmolLM2-135M-Instruct", "prompt": "Hello", "max_tokens": 3}).encode()
    req = urllib.request.Request(
        f"{traced.http_url}/v1/completions",
        data=body,
        headers={"Content-Type": "application/json", "traceparent": f"00-{trace_id}-{CLIENT_SPAN_ID}-01"},
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        assert resp.status == 200

    def done(spans: list[ReceivedSpan]) -> bool:
        mine = [s for s in spans if s.trace_id == trace_id]
        return any(s.service == SERVICES["scheduler"] for s in mine) and any(
            s.parent_span_id == CLIENT_SPAN_ID for s in mine
        )

    spans = [s for s in receiver.wait_for(done) if s.trace_id == trace_id]
    (http,) = [s for s in spans if s.parent_span_id == CLIENT_SPAN_ID]
    assert http.service == SERVICES["frontend"] and http.name == "POST /v1/completions"
    (gen,) = _children(spans, http)
    assert gen.name == "text_completion SmolLM2-135M-Instruct" and gen.attributes["gen_ai.request.stream"] is False
    assert not [s for s in spans if s.name.startswith("POST /v1/completions http ")]  # no per-chunk send spans


def test_health_checks_scrapes_and_stats_are_not_traced(traced: LocalCluster, receiver: OtlpReceiver) -> None:
    for _ in range(3):
        for s in traced.services:
            check(s.addr, s.health_service)
        scrape(f"{traced.http_url}/metrics")  # the frontend calls the scheduler's Stats for it
        urllib.request.urlopen(f"{traced.http_url}/health", timeout=10).read()
    _generate_traced(traced, "c" * 32, max_tokens=2)  # a marker: its spans are exported after the probes'
    spans = receiver.wait_for(lambda s: any(x.trace_id == "c" * 32 and x.name == "decode" for x in s))
    names = {s.name for s in spans}
    assert not [n for n in names if "Health" in n or "Reflection" in n or n.endswith("/Stats")], names
    assert not [n for n in names if n.startswith("GET /health") or n.startswith("GET /metrics")], names


def test_metrics_move_with_requests(traced: LocalCluster) -> None:
    frontend = f"{traced.http_url}/metrics"
    scheduler = f"http://127.0.0.1:{traced.metrics_port('scheduler')}/metrics"
    worker = f"http://127.0.0.1:{traced.metrics_port('worker0')}/metrics"
    before = {u: scrape(u) for u in (frontend, scheduler, worker)}
    with GenerationClient(traced.frontend_addr) as client:
        for _ in range(2):
            result = client.generate(text_request("One two three", max_tokens=5))
    after = {u: scrape(u) for u in (frontend, scheduler, worker)}
    assert result.final is not None
    prompt = result.final.usage.prompt_tokens

    def moved(url: str, name: str, **labels: str) -> float:
        return _total(after[url], name, **labels) - _total(before[url], name, **labels)

    model = {"model_name": "SmolLM2-135M-Instruct"}
    assert moved(frontend, "pagoda:prompt_tokens_total", **model) == 2 * prompt
    assert moved(frontend, "pagoda:generation_tokens_total", **model) == 10
    assert moved(frontend, "pagoda:request_success_total", finished_reason="length", **model) == 2
    for h in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
              "request_prefill_time_seconds", "request_decode_time_seconds", "request_prompt_tokens",
              "request_generation_tokens"):  # fmt: skip
        assert moved(frontend, f"pagoda:{h}_count", **model) == 2, h
    assert moved(frontend, "pagoda:request_generation_tokens_sum") == 10
    assert moved(frontend, "pagoda:inter_token_latency_seconds_count") == 8  # 4 gaps per 5-token request
    # the scheduler's engine state, in the frontend's page and its own
    for url in (frontend, scheduler):
        page = after[url]
        assert _total(page, "pagoda:num_requests_running", **model) == 0
        assert _total(page, "pagoda:num_requests_waiting", **model) == 0
        assert 0 <= _total(page, "pagoda:kv_cache_usage_perc", **model) <= 1
        assert _total(page, "pagoda:prefix_cache_queries_total", **model) >= _total(
            page, "pagoda:prefix_cache_hits_total", **model
        )
        assert "pagoda:num_preemptions_total" in page
    assert moved(scheduler, "pagoda:iteration_tokens_total_count", **model) >= 10
    assert moved(scheduler, "pagoda:iteration_tokens_total_sum", **model) >= 2 * prompt + 8
    assert moved(worker, "pagoda:worker_step_duration_seconds_count", **model) >= 10
    assert moved(worker, "pagoda:worker_batch_size_count", **model) >= 10


def test_request_log_lines_carry_the_trace_id(traced: LocalCluster, receiver: OtlpReceiver) -> None:
    trace_id = "d" * 32
    rid = _generate_traced(traced, trace_id, max_tokens=2)
    log = Path(traced.config.log_dir or "") / "frontend.log"
    lines = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    finished = [x for x in lines if x.get("event") == "request finished" and x.get("request_id") == rid]
    assert len(finished) == 1
    line = finished[0]
    assert line["trace_id"] == trace_id and len(line["span_id"]) == 16
    assert line["completion_tokens"] == 2 and line["finish_reasons"] == ["length"]
    assert "prompt" not in line and "The capital" not in json.dumps(line)


def _open_stream(channel: grpc.Channel, requests: queue.Queue[bytes | None]) -> Iterator[bytes]:
    """A raw `Stream` call (bytes both ways, so a test can send what no client would), its requests from a queue."""
    call = channel.stream_stream("/pagoda.v1.Scheduler/Stream", lambda b: b, lambda b: b)
    return call(iter(requests.get, None), timeout=120)


def _submit(tag: int, trace_id: str, max_tokens: int) -> bytes:
    submit = scheduler_pb2.SubmitRequest(
        request_id=f"aborted-{trace_id[:8]}",
        prompt_token_ids=[1, 504, 3458, 282, 260, 1345, 28, 216],
        sampling=common_pb2.SamplingOptions(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
        tag=tag,
        trace=common_pb2.TraceContext(traceparent=f"00-{trace_id}-{CLIENT_SPAN_ID}-01"),
    )
    return scheduler_pb2.StreamRequest(submit=submit).SerializeToString()


def _until_tokens(responses: Iterator[bytes]) -> None:
    for raw in responses:
        if any(m.outputs for m in scheduler_pb2.StreamResponse.FromString(raw).responses):
            return
    raise AssertionError("the call ended before the request had tokens")


def test_a_stream_request_aborted_by_its_caller_ends_its_span_in_error(
    traced: LocalCluster, receiver: OtlpReceiver
) -> None:
    by_tag, call_ended = "e" * 32, "f" * 32
    with grpc.insecure_channel(traced.scheduler_addr) as channel:
        requests: queue.Queue[bytes | None] = queue.Queue()
        responses = _open_stream(channel, requests)
        requests.put(_submit(1, by_tag, 150))
        _until_tokens(responses)
        requests.put(scheduler_pb2.StreamRequest(cancel=1).SerializeToString())
        requests.put(None)  # half-closed, its one request cancelled: the scheduler ends the call
        list(responses)  # until the call ends
        requests = queue.Queue()
        responses = _open_stream(channel, requests)
        requests.put(_submit(1, call_ended, 150))
        _until_tokens(responses)
        responses.cancel()  # type: ignore[attr-defined]  # the frontend went away

    def ended(spans: list[ReceivedSpan]) -> bool:
        return {by_tag, call_ended} <= {s.trace_id for s in spans if s.name == SUBMIT_SPAN}

    spans = [s for s in receiver.wait_for(ended) if s.name == SUBMIT_SPAN and s.trace_id in (by_tag, call_ended)]
    assert [(s.service, s.status_code) for s in spans] == [(SERVICES["scheduler"], STATUS_CODE_ERROR)] * 2


def test_a_broken_request_stream_is_logged_and_its_requests_run_on(traced: LocalCluster) -> None:
    trace_id = "c" * 32
    with grpc.insecure_channel(traced.scheduler_addr) as channel:
        requests: queue.Queue[bytes | None] = queue.Queue()
        responses = _open_stream(channel, requests)
        requests.put(_submit(1, trace_id, 4))
        requests.put(b"\xff\xff\xff")  # not a StreamRequest: the scheduler's reading of this call fails
        requests.put(None)
        msgs = [m for raw in responses for m in scheduler_pb2.StreamResponse.FromString(raw).responses]
    assert msgs[-1].finished and not msgs[-1].error_code  # the request admitted before it ran to its end
    assert sum(len(o.new_token_ids) for m in msgs for o in m.outputs) == 4
    log = Path(traced.config.log_dir or "") / "scheduler.log"
    deadline = time.monotonic() + 10
    while True:
        lines = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
        failed = [x for x in lines if x.get("event") == "a frontend's request stream failed"]
        if failed or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert len(failed) == 1 and "DecodeError" in failed[0]["error"], failed
