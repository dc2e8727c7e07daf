"""engine_core's Executor over gRPC: the scheduler's side of the worker service.

Every rank receives the same step (tensor-parallel ranks must run the same batch); only rank 0 is asked to return
samples, the others acknowledge. A step fails as a whole if any rank fails.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

import grpc
import structlog
from opentelemetry.trace import Span

from engine_core.plan import ModelRunnerOutput, SchedulerOutput
from services.common.grpc_opts import CHANNEL_OPTIONS
from services.common.health import wait_serving
from services.common.tls import TlsFiles, sync_channel
from services.common.trace import TraceContext
from services.convert.plan import plan_to_proto, result_from_proto
from services.rpc import WORKER_SERVICE, worker_pb2, worker_pb2_grpc
from services.scheduler.metrics import StepMetrics
from services.scheduler.tracing import StepTracer

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class WorkerGroupInfo:
    """What the workers agree on (checked at connect)."""

    model: str
    architecture: str
    vocab_size: int
    max_model_len: int
    block_size: int
    max_num_seqs: int
    num_kv_blocks: int  # the minimum over the ranks


class WorkerMismatchError(RuntimeError):
    pass


# NOTE: the first steps of a fresh cache may compile kernels (Triton JIT, first-use native builds): they get this
# much time at least, so a slow warm-up is not mistaken for a hung worker.
WARMUP_STEPS = 4
WARMUP_STEP_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class StepDeadline:
    """How long one Execute may take: a base plus a part per scheduled token (a long prefill takes longer)."""

    base_s: float = 15.0
    per_token_s: float = 0.02

    def for_step(self, step: int, num_tokens: int) -> float:
        timeout = self.base_s + self.per_token_s * num_tokens
        return max(timeout, WARMUP_STEP_TIMEOUT_S) if step < WARMUP_STEPS else timeout


class RemoteStep:
    """A step sent to the workers: `result` waits for every rank and returns rank 0's samples."""

    def __init__(self, executor: RemoteExecutor, futures: list[grpc.Future], span: Span | None, own_s: float) -> None:
        self._executor = executor
        self._futures = futures
        self._span = span
        self.own_s = own_s  # its deadline without the wait for a step ahead of it
        self.done = False
        self.num_drafts = 0  # draft tokens it verifies (its span reports how many were accepted)

    def result(self) -> ModelRunnerOutput:
        resp = None
        try:
            for f in self._futures[1:]:
                f.result()
            resp = self._futures[0].result()
        finally:
            self.done = True
            if self._span is not None:
                if self.num_drafts and resp is not None:
                    # A verified sequence's rows beyond its first are its accepted drafts.
                    accepted = len(resp.seq_ids) - len(set(resp.seq_ids))
                    self._span.set_attribute("pagoda.step.num_accepted_tokens", accepted)
                self._span.end()
        self._executor.last_worker_s = resp.execute_s
        return result_from_proto(resp)


class RemoteExecutor:
    def __init__(
        self, addrs: list[str], deadline: StepDeadline, tls: TlsFiles | None = None, dist_init_addr: str = ""
    ) -> None:
        self.addrs = addrs
        self.dist_init_addr = dist_init_addr  # tensor parallelism (len(addrs) > 1): the ranks' rendezvous
        self.deadline = deadline
        self.tls = tls or TlsFiles()
        self._channels = [sync_channel(a, self.tls, CHANNEL_OPTIONS) for a in addrs]
        self._stubs = [worker_pb2_grpc.WorkerStub(c) for c in self._channels]
        self.epoch = ""
        self.step = 0
        self.last_worker_s = 0.0  # the worker's own time on the last step (the rest is transport)
        self._last: RemoteStep | None = None  # the last step sent
        self.step_tracer: StepTracer | None = None  # detailed traces only
        self.step_metrics: StepMetrics | None = None

    def connect(self, timeout: float) -> WorkerGroupInfo:
        """Waits for every rank to be SERVING and checks that they run the same model the same way."""
        deadline = time.monotonic() + timeout
        for addr in self.addrs:
            wait_serving(addr, WORKER_SERVICE, timeout=max(1.0, deadline - time.monotonic()), tls=self.tls)
        profiles = [stub.Profile(worker_pb2.ProfileRequest(), timeout=60.0) for stub in self._stubs]
        first = profiles[0]
        for addr, prof in zip(self.addrs, profiles, strict=True):
            for name in ("model", "architecture", "vocab_size", "max_model_len", "block_size", "dtype"):
                if getattr(prof, name) != getattr(first, name):
                    raise WorkerMismatchError(
                        f"worker {addr} has {name}={getattr(prof, name)!r}, rank 0 has {getattr(first, name)!r}"
                    )
        return WorkerGroupInfo(
            model=first.model,
            architecture=first.architecture,
            vocab_size=first.vocab_size,
            max_model_len=first.max_model_len,
            block_size=first.block_size,
            max_num_seqs=min(p.max_num_seqs for p in profiles),
            num_kv_blocks=min(p.num_kv_blocks for p in profiles),
        )

    def init_cache(self, num_blocks: int) -> None:
        """Allocates the cache on every rank under a fresh epoch (a restarted worker cannot run stale steps)."""
        self.epoch = uuid.uuid4().hex
        self.step = 0
        if self.step_tracer is not None:
            self.step_tracer.reset()
        world = len(self._stubs)
        # NOTE: concurrently: under tensor parallelism each rank's InitCache returns only once every rank has joined
        # the group.
        futures = [
            stub.InitCache.future(
                worker_pb2.InitCacheRequest(
                    num_blocks=num_blocks,
                    rank=rank,
                    world_size=world,
                    epoch=self.epoch,
                    dist_init_addr=self.dist_init_addr,
                ),
                timeout=120.0,
            )
            for rank, stub in enumerate(self._stubs)
        ]
        for f in futures:
            f.result()

    def execute(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        return self.submit(plan).result()

    def submit(self, plan: SchedulerOutput) -> RemoteStep:
        """Sends the step to every rank and returns at once; the workers run steps in the order they were sent."""
        span = self.step_tracer.start(plan, self.step) if self.step_tracer is not None else None
        if self.step_metrics is not None:
            self.step_metrics.observe(plan.total_num_scheduled_tokens)
        try:
            req = plan_to_proto(plan, epoch=self.epoch, step=self.step)
            own_s = self.deadline.for_step(self.step, plan.total_num_scheduled_tokens)
            # NOTE: a step sent while another runs waits for it on the worker: it also gets that one's own time.
            last = self._last
            timeout = own_s + (last.own_s if last is not None and not last.done else 0.0)
            self.step += 1
            req.return_samples = True
            if span is not None:
                req.trace.CopyFrom(TraceContext.of_span(span).to_proto())
            # NOTE: futures: the ranks run concurrently; the step is as slow as the slowest rank.
            futures = [self._stubs[0].Execute.future(req, timeout=timeout)]
            if len(self._stubs) > 1:
                others = worker_pb2.ExecuteRequest()
                others.CopyFrom(req)
                others.return_samples = False
                futures += [s.Execute.future(others, timeout=timeout) for s in self._stubs[1:]]
        except BaseException:
            if span is not None:
                span.end()
            raise
        self._last = RemoteStep(self, futures, span, own_s)
        self._last.num_drafts = sum(len(d) for d in plan.scheduled_spec_decode_tokens.values())
        return self._last

    def heartbeat(self, timeout: float) -> str | None:
        """None when every rank answers on our epoch; else what is wrong (dead, hung, restarted or reset)."""
        for addr, stub in zip(self.addrs, self._stubs, strict=True):
            try:
                resp = stub.Heartbeat(worker_pb2.HeartbeatRequest(), timeout=timeout)
            except grpc.RpcError as e:
                return f"worker {addr} does not answer: {e.code().name}"
            if resp.epoch != self.epoch:
                return f"worker {addr} lost its cache (restarted or reset)"
        return None

    def close(self) -> None:
        for channel in self._channels:
            channel.close()
