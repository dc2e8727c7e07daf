"""Time to resume after a worker is SIGKILLed mid-stream: from the kill to each stream's next token.

A local cluster (the packaged model unless --model; one worker) serves `--streams` concurrent greedy streams; once
each has received some tokens, the worker is SIGKILLed. `pagoda serve`'s supervisor (services/supervisor.py, its
default backoff) restarts it, the scheduler re-forms the group and the streams resume (recomputing their tokens so
far). Per round it reports: the worker back SERVING (restart backoff + process start + model load), each stream's
first token after the kill (p50 / max), and whether every stream's tokens equal an undisturbed round's.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/failover.py [--rounds 3] [--streams 4] [--max-tokens 128]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc

from services.client import GenerationClient, text_request
from services.common.health import SERVING, check
from services.launcher import LaunchConfig, LocalCluster
from services.rpc import WORKER_SERVICE, generation_pb2
from services.supervisor import Supervisor

RESULTS = Path(__file__).parent / "results"
PROMPT = "Tell me a very long story about a lighthouse keeper and the sea. " * 12


@dataclass
class Stream:
    request: generation_pb2.GenerateRequest
    tokens: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)  # receipt time of each message with tokens
    error: str = ""

    def run(self, client: GenerationClient) -> None:
        try:
            for msg in client.stream(self.request):
                for c in msg.choices:
                    if c.token_ids:
                        self.tokens.extend(c.token_ids)
                        self.times.append(time.monotonic())
        except grpc.RpcError as e:
            self.error = f"{e.code().name}: {e.details()}"


@dataclass
class Round:
    worker_serving_s: float  # kill -> restarted worker SERVING
    resume_p50_s: float  # kill -> next token, over the streams
    resume_max_s: float
    identical: bool  # every stream's tokens equal the undisturbed round's
    errors: list[str]


def run_streams(client: GenerationClient, args: argparse.Namespace, kill: LocalCluster | None) -> tuple[list, Round]:
    streams = [
        Stream(text_request(f"{PROMPT} Part {i}.", max_tokens=args.max_tokens, ignore_eos=True))
        for i in range(args.streams)
    ]
    threads = [threading.Thread(target=s.run, args=(client,), daemon=True) for s in streams]
    for t in threads:
        t.start()
    killed_at = serving_s = 0.0
    if kill is not None:
        while not all(len(s.tokens) >= args.tokens_before_kill or s.error for s in streams):
            time.sleep(0.01)
        worker = kill.service("worker0")
        killed_at = time.monotonic()
        worker.process.kill()
        while check(worker.addr, WORKER_SERVICE, timeout=0.5) != SERVING:
            time.sleep(0.05)
        serving_s = time.monotonic() - killed_at
    for t in threads:
        t.join()
    resumes = [next((t - killed_at for t in s.times if t > killed_at), float("nan")) for s in streams]
    result = Round(
        worker_serving_s=round(serving_s, 3),
        resume_p50_s=round(statistics.median(resumes), 3) if kill is not None else 0.0,
        resume_max_s=round(max(resumes), 3) if kill is not None else 0.0,
        identical=False,
        errors=[s.error for s in streams if s.error],
    )
    return [s.tokens for s in streams], result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--tokens-before-kill", type=int, default=16)
    p.add_argument("--dtype", default="float32")
    args = p.parse_args()
    log_dir = tempfile.mkdtemp(prefix="failover-bench-")
    config = LaunchConfig.on_loopback(
        model=args.model, dtype=args.dtype, kv_cache_memory=0.25, num_threads=1, max_num_seqs=8,
        log_dir=log_dir, metrics_port=-1,
    )  # fmt: skip
    cluster = LocalCluster(config)
    cluster.start()
    stop = threading.Event()
    try:
        cluster.wait_healthy(600)
        supervisor = Supervisor(cluster, lambda name: name.startswith("worker"))

        def supervise() -> None:
            while not stop.wait(0.1):
                supervisor.check()

        threading.Thread(target=supervise, daemon=True).start()
        rounds: list[Round] = []
        with GenerationClient(cluster.frontend_addr) as client:
            reference, _ = run_streams(client, args, None)
            for _ in range(args.rounds):
                tokens, result = run_streams(client, args, cluster)
                result.identical = tokens == reference and not result.errors
                rounds.append(result)
                print(result, flush=True)
    finally:
        stop.set()
        cluster.stop(timeout=30)
    load = os.getloadavg()
    summary = {
        "args": vars(args),
        "load_average": [round(x, 2) for x in load],
        "cpus": os.cpu_count(),
        "rounds": [asdict(r) for r in rounds],
        "resume_p50_s_median": statistics.median(r.resume_p50_s for r in rounds),
        "worker_serving_s_median": statistics.median(r.worker_serving_s for r in rounds),
        "all_identical": all(r.identical for r in rounds),
    }
    print(json.dumps({k: v for k, v in summary.items() if k != "rounds"}, indent=2))
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"failover-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(summary, indent=2))
    print(f"wrote {path}  (logs: {log_dir})")


if __name__ == "__main__":
    main()
