"""Soak: mixed concurrent traffic through the real services for a while, then everything must be back to idle.

Random sampling parameters, n > 1, prompts near max_model_len, random cancels, gRPC and HTTP (streaming and not),
on a KV pool small enough to force preemption. At the end: every request finished or was cancelled with the right
status, every KV block is free (cached ones are evictable), no process died and their memory is stable.

Short in CI (PAGODA_SOAK_SECONDS, default 45); run longer with e.g. `PAGODA_SOAK_SECONDS=1800 pytest tests/soak`.
"""

from __future__ import annotations

import json
import os
import random
import threading
import time
from collections import Counter
from collections.abc import Iterator

import grpc
import pytest
import requests

from services.client import GenerationClient
from services.launcher import LocalCluster
from services.rpc import common_pb2, generation_pb2
from tests.services.probes import all_blocks_free, print_logs, rss_bytes, scheduler_stats, start_cluster, wait_until

pytestmark = pytest.mark.slow

SOAK_SECONDS = float(os.environ.get("PAGODA_SOAK_SECONDS", "45"))
CLIENTS = 6
MAX_MODEL_LEN = 256
NUM_KV_BLOCKS = 40  # 640 tokens: two or three long sequences at once, so the scheduler must preempt
OK_REASONS = {
    common_pb2.FINISH_REASON_STOP_TOKEN,
    common_pb2.FINISH_REASON_STOP_STRING,
    common_pb2.FINISH_REASON_LENGTH,
}


@pytest.fixture(scope="module")
def soak_cluster(smollm2_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    log_dir = tmp_path_factory.mktemp("soak")
    cluster = start_cluster(
        log_dir,
        max_num_seqs=8,
        extra_worker_args=["--num-kv-blocks", str(NUM_KV_BLOCKS), "--max-model-len", str(MAX_MODEL_LEN)],
    )
    yield cluster
    codes = cluster.stop(timeout=60)
    if codes != {"frontend": 0, "scheduler": 0, "worker0": 0}:
        print_logs(log_dir)
    assert codes == {"frontend": 0, "scheduler": 0, "worker0": 0}, codes


class Tally:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.counts: Counter[str] = Counter()
        self.failures: list[str] = []

    def add(self, key: str, failure: str | None = None) -> None:
        with self.lock:
            self.counts[key] += 1
            if failure is not None:
                self.failures.append(failure)


def _params(rng: random.Random, max_tokens: int) -> common_pb2.SamplingOptions:
    opts = common_pb2.SamplingOptions(
        max_tokens=max_tokens,
        n=rng.choice([1, 1, 2, 3]),
        temperature=rng.choice([0.0, 0.7, 1.0]),
        top_p=rng.choice([1.0, 0.9]),
        top_k=rng.choice([0, 20]),
        ignore_eos=rng.random() < 0.3,
    )
    if rng.random() < 0.4:
        opts.seed = rng.randrange(2**63 - 4)
    if rng.random() < 0.2:
        opts.stop.append(rng.choice(["\n", ".", " the"]))
    if rng.random() < 0.2:
        opts.logprobs = rng.randint(0, 3)
    return opts


def _prompt(rng: random.Random, vocab: int, max_tokens: int) -> list[int]:
    near_max = rng.random() < 0.3
    length = MAX_MODEL_LEN - max_tokens - 1 if near_max else rng.randint(4, 48)
    return [rng.randrange(vocab) for _ in range(length)]


def _grpc(client: GenerationClient, rng: random.Random, vocab: int, tally: Tally) -> None:
    max_tokens = rng.randint(1, 48)
    opts = _params(rng, max_tokens)
    request = generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=_prompt(rng, vocab, max_tokens)))
    request.sampling.CopyFrom(opts)
    cancel_after = rng.randint(0, 6) if rng.random() < 0.25 else None
    call = client.stub.Generate(request, timeout=300)
    final = None
    try:
        for i, msg in enumerate(call):
            if cancel_after is not None and i >= cancel_after:
                call.cancel()
            if msg.HasField("final"):
                final = msg.final
    except grpc.RpcError as e:
        if e.code() == grpc.StatusCode.CANCELLED and cancel_after is not None:
            tally.add("grpc cancelled")
            return
        tally.add("grpc failed", f"gRPC {e.code().name}: {e.details()}")
        return
    if final is None:
        tally.add("grpc failed", "stream ended without a final message")
        return
    reasons = {c.finish_reason for c in final.choices}
    bad = (
        len(final.choices) != opts.n or not reasons <= OK_REASONS or final.usage.completion_tokens > max_tokens * opts.n
    )
    tally.add("grpc finished", f"bad final {final}" if bad else None)


def _http(url: str, rng: random.Random, vocab: int, tally: Tally) -> None:
    max_tokens = rng.randint(1, 32)
    opts = _params(rng, max_tokens)
    body: dict[str, object] = {
        "prompt": _prompt(rng, vocab, max_tokens),
        "max_tokens": max_tokens,
        "n": opts.n,
        "temperature": opts.temperature,
        "top_p": opts.top_p,
        "top_k": opts.top_k,
        "ignore_eos": opts.ignore_eos,
        "stream": rng.random() < 0.5,
    }
    if opts.HasField("seed"):
        body["seed"] = opts.seed
    r = requests.post(f"{url}/v1/completions", json=body, timeout=300)
    if r.status_code != 200:
        tally.add("http failed", f"HTTP {r.status_code}: {r.text[:200]}")
        return
    if body["stream"]:
        lines = [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: ")]
        ok = lines and lines[-1] == "[DONE]" and all('"error"' not in ln for ln in lines)
        reasons = [c["finish_reason"] for ln in lines[:-1] for c in json.loads(ln)["choices"] if c["finish_reason"]]
    else:
        choices = r.json()["choices"]
        ok = len(choices) == opts.n
        reasons = [c["finish_reason"] for c in choices]
    ok = ok and len(reasons) == opts.n and set(reasons) <= {"stop", "length"}
    tally.add("http finished", None if ok else f"bad HTTP result: {r.text[:4000]}")


def test_soak(soak_cluster: LocalCluster) -> None:
    url = soak_cluster.http_url
    with GenerationClient(soak_cluster.frontend_addr) as client:
        vocab = client.model_info().vocab_size
        tally = Tally()
        stop_at = time.monotonic() + SOAK_SECONDS
        rss_warm: dict[str, int] = {}

        def worker(seed: int) -> None:
            rng = random.Random(seed)
            while time.monotonic() < stop_at:
                try:
                    if rng.random() < 0.7:
                        _grpc(client, rng, vocab, tally)
                    else:
                        _http(url, rng, vocab, tally)
                except Exception as e:  # NOTE: a client-side surprise is a failure to report, not a hang
                    tally.add("client error", repr(e))

        threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(CLIENTS)]
        for t in threads:
            t.start()
        time.sleep(SOAK_SECONDS / 3)  # NOTE: memory after warm-up (caches, allocator pools) is the baseline
        rss_warm = {s.name: rss_bytes(s.process.pid) for s in soak_cluster.services}
        for t in threads:
            t.join(SOAK_SECONDS + 300)
            assert not t.is_alive(), "a client hung"
        wait_until(lambda: all_blocks_free(soak_cluster.scheduler_addr), 60, "every block free after the soak")
        stats = scheduler_stats(soak_cluster.scheduler_addr)
        assert stats is not None
        rss_end = {s.name: rss_bytes(s.process.pid) for s in soak_cluster.services}
        mib_warm = {k: v >> 20 for k, v in rss_warm.items()}
        mib_end = {k: v >> 20 for k, v in rss_end.items()}
        print(
            f"soak {SOAK_SECONDS:.0f} s: {dict(tally.counts)}, preemptions {stats.preemptions}, "
            f"blocks free {stats.free_blocks}/{stats.total_blocks}, steps {stats.steps}, "
            f"RSS MiB warm {mib_warm} end {mib_end}"
        )
        assert not tally.failures, tally.failures[:10]
        assert tally.counts["grpc finished"] > 0 and tally.counts["http finished"] > 0
        assert stats.preemptions > 0, "the KV pool was meant to force preemption"
        assert all(s.process.poll() is None for s in soak_cluster.services), "a process died"
        for name, warm in rss_warm.items():
            assert rss_end[name] <= warm * 1.5 + (64 << 20), (
                f"{name} RSS grew from {warm >> 20} to {rss_end[name] >> 20} MiB"
            )
        # Still serving normally afterwards.
        result = client.generate(
            generation_pb2.GenerateRequest(text="Hello", sampling=common_pb2.SamplingOptions(max_tokens=3))
        )
        assert len(result.choices[0].token_ids) == 3
