"""The soak's clients: what each kind sends, and which outcomes count as correct.

Outcomes are counted by kind. A failure is anything but: a normal end with the right number of choices and finish
reasons, a cancel the client made, a stream cut off by `--stream-send-timeout` because the client stopped reading,
or UNAVAILABLE / HTTP 503 for a request that overlapped the worker's outage (retryable, as documented).
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections import Counter
from random import Random

import grpc
import requests

from services.client import GenerationClient
from services.rpc import common_pb2, generation_pb2, generation_pb2_grpc

MAX_MODEL_LEN = 256
MAX_LOGPROBS = 20
OK_REASONS = {
    common_pb2.FINISH_REASON_STOP_TOKEN,
    common_pb2.FINISH_REASON_STOP_STRING,
    common_pb2.FINISH_REASON_LENGTH,
}
# NOTE: grace after the frontend serves again: a request admitted just before it noticed can still fail.
OUTAGE_GRACE_S = 5.0


def sampling(rng: Random, max_tokens: int, vocab: int) -> common_pb2.SamplingOptions:
    """Every sampling control, drawn over its whole valid range (SamplingParams.validate), endpoints included.

    Temperature and repetition_penalty have no upper bound: drawn log-uniformly over four decades around 1."""
    n = rng.choice([1, 1, 2, 3])
    opts = common_pb2.SamplingOptions(
        max_tokens=max_tokens,
        n=n,
        temperature=rng.choice([0.0, 1.0, 10 ** rng.uniform(-2, 2)]),
        top_p=rng.choice([1.0, rng.uniform(1e-3, 1.0)]),
        top_k=rng.choice([0, -1, 1, rng.randint(1, vocab)]),
        min_p=rng.choice([0.0, 1.0, rng.uniform(0.0, 1.0)]),
        repetition_penalty=rng.choice([1.0, 10 ** rng.uniform(-2, 2)]),
        frequency_penalty=rng.choice([0.0, -2.0, 2.0, rng.uniform(-2.0, 2.0)]),
        presence_penalty=rng.choice([0.0, -2.0, 2.0, rng.uniform(-2.0, 2.0)]),
        min_tokens=rng.choice([0, rng.randint(0, max_tokens)]),
        ignore_eos=rng.random() < 0.3,
        skip_special_tokens=rng.random() < 0.8,
        include_stop_str_in_output=rng.random() < 0.2,
    )
    if rng.random() < 0.4:
        opts.seed = rng.randrange(-(2**63), 2**63 - n)  # NOTE: seed + n - 1 must fit int64
    if rng.random() < 0.2:
        opts.stop.append(rng.choice(["\n", ".", " the"]))
    if rng.random() < 0.2:
        opts.stop_token_ids.extend(rng.randrange(vocab) for _ in range(rng.randint(1, 4)))
    if rng.random() < 0.2:
        for _ in range(rng.randint(1, 8)):
            opts.logit_bias[rng.randrange(vocab)] = rng.choice([-100.0, 100.0, rng.uniform(-100.0, 100.0)])
    if rng.random() < 0.2:
        opts.logprobs = rng.randint(0, MAX_LOGPROBS)
    if rng.random() < 0.1:
        opts.prompt_logprobs = rng.randint(0, MAX_LOGPROBS)
    return opts


def prompt(rng: Random, vocab: int, max_tokens: int) -> list[int]:
    near_max = rng.random() < 0.3
    length = MAX_MODEL_LEN - max_tokens - 1 if near_max else rng.randint(4, 48)
    return [rng.randrange(vocab) for _ in range(length)]


class Traffic:
    def __init__(
        self,
        client: GenerationClient,
        unread_stub: generation_pb2_grpc.GenerationStub,
        http_url: str,
        vocab: int,
        send_timeout_s: float,
    ) -> None:
        self.client = client
        self.unread_stub = unread_stub
        self.http_url = http_url
        self.vocab = vocab
        self.send_timeout_s = send_timeout_s
        self.lock = threading.Lock()
        self.counts: Counter[str] = Counter()
        self.failures: list[str] = []
        self.ended_early_ids: list[str] = []  # cancelled or cut off: their ids must be free again afterwards
        self._outage: tuple[float, float] | None = None  # (began, ended) on time.monotonic()

    # ---- outcomes ------------------------------------------------------------------------------------------------
    def outage_begins(self) -> None:
        with self.lock:
            self._outage = (time.monotonic(), float("inf"))

    def outage_ends(self) -> None:
        with self.lock:
            assert self._outage is not None
            self._outage = (self._outage[0], time.monotonic() + OUTAGE_GRACE_S)

    def _in_outage(self, began: float) -> bool:
        outage = self._outage
        return outage is not None and began <= outage[1] and time.monotonic() >= outage[0]

    def add(self, kind: str, failure: str | None = None, rid: str | None = None) -> None:
        with self.lock:
            self.counts[kind] += 1
            if failure is not None:
                self.failures.append(f"{kind}: {failure}")
            if rid is not None:
                self.ended_early_ids.append(rid)

    def _unavailable(self) -> None:
        self.add("unavailable during the worker outage")
        time.sleep(0.25)  # NOTE: a client backs off before retrying (the outage lasts seconds)

    def _rpc_error(self, kind: str, e: grpc.RpcError, began: float) -> None:
        if e.code() == grpc.StatusCode.UNAVAILABLE and self._in_outage(began):
            self._unavailable()
        else:
            self.add(kind, f"gRPC {e.code().name}: {e.details()}")

    # ---- one request of a random kind ------------------------------------------------------------------------------
    def one(self, rng: Random) -> None:
        began = time.monotonic()
        try:
            r = rng.random()
            if r < 0.55:
                self._grpc(rng, began)
            elif r < 0.65:
                self._slow_reader(rng, began)
            elif r < 0.75:
                self._unread(rng, began)
            else:
                self._http(rng, began)
        except Exception as e:  # NOTE: a client-side surprise is a failure to report, not a hang
            self.add("client error", repr(e))

    def _request(
        self, rng: Random, max_tokens: int
    ) -> tuple[generation_pb2.GenerateRequest, common_pb2.SamplingOptions]:
        opts = sampling(rng, max_tokens, self.vocab)
        ids = generation_pb2.TokenIds(ids=prompt(rng, self.vocab, max_tokens))
        return generation_pb2.GenerateRequest(token_ids=ids, sampling=opts, request_id=uuid.uuid4().hex), opts

    def _check_final(self, kind: str, final: generation_pb2.FinalInfo | None, opts: common_pb2.SamplingOptions) -> None:
        if final is None:
            self.add(kind, "stream ended without a final message")
            return
        reasons = {c.finish_reason for c in final.choices}
        too_many = final.usage.completion_tokens > opts.max_tokens * opts.n
        bad = len(final.choices) != opts.n or not reasons <= OK_REASONS or too_many or final.error
        self.add(kind, f"bad final {final}" if bad else None)

    def _grpc(self, rng: Random, began: float) -> None:
        """A gRPC stream read at full speed; a quarter are cancelled after a few messages."""
        request, opts = self._request(rng, rng.randint(1, 48))
        cancel_after = rng.randint(0, 6) if rng.random() < 0.25 else None
        call = self.client.stub.Generate(request, timeout=300)
        final = None
        try:
            for i, msg in enumerate(call):
                if cancel_after is not None and i >= cancel_after:
                    call.cancel()
                if msg.HasField("final"):
                    final = msg.final
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.CANCELLED and cancel_after is not None:
                self.add("grpc cancelled", rid=request.request_id)
            else:
                self._rpc_error("grpc failed", e, began)
            return
        self._check_final("grpc finished", final, opts)

    def _slow_reader(self, rng: Random, began: float) -> None:
        """Reads slowly (well within --stream-send-timeout per message): must finish normally, never be cut."""
        request, opts = self._request(rng, rng.randint(8, 48))
        opts.ClearField("logprobs")  # NOTE: small messages: the client's window holds many, a send never waits long
        request.sampling.CopyFrom(opts)
        final = None
        try:
            for msg in self.client.stub.Generate(request, timeout=300):
                time.sleep(rng.uniform(0.02, 0.2))
                if msg.HasField("final"):
                    final = msg.final
        except grpc.RpcError as e:
            self._rpc_error("slow reader failed", e, began)
            return
        self._check_final("slow reader finished", final, opts)

    def _unread(self, rng: Random, began: float) -> None:
        """Reads the first message, then nothing for a while: cut off with RESOURCE_EXHAUSTED (or, if everything fit
        in the buffers, finished normally); then reads what was buffered, up to the status."""
        request, opts = self._request(rng, rng.randint(100, 140))
        # NOTE: 3 choices of 100+ tokens with 20 logprobs each: over 130 KB, more than the client's 64 KiB window
        # and the frontend's write buffer hold, so the send stalls; short prompts, so the choices fit the KV pool.
        opts.n, opts.logprobs, opts.ignore_eos, opts.min_tokens = 3, MAX_LOGPROBS, True, 0
        for name in ("prompt_logprobs", "stop", "stop_token_ids"):
            opts.ClearField(name)
        request.sampling.CopyFrom(opts)
        del request.token_ids.ids[24:]
        call = self.unread_stub.Generate(request, timeout=300)
        final = None
        try:
            next(call)
            time.sleep(self.send_timeout_s * 4)
            for msg in call:
                if msg.HasField("final"):
                    final = msg.final
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "--stream-send-timeout" in (e.details() or ""):
                self.add("grpc unread cut off", rid=request.request_id)
            else:
                self._rpc_error("grpc unread failed", e, began)
            return
        self._check_final("grpc unread finished", final, opts)

    def _http(self, rng: Random, began: float) -> None:
        max_tokens = rng.randint(1, 32)
        opts = sampling(rng, max_tokens, self.vocab)
        body: dict[str, object] = {
            "prompt": prompt(rng, self.vocab, max_tokens),
            "max_tokens": max_tokens,
            "n": opts.n,
            "temperature": opts.temperature,
            "top_p": opts.top_p,
            "top_k": opts.top_k,
            "min_p": opts.min_p,
            "repetition_penalty": opts.repetition_penalty,
            "frequency_penalty": opts.frequency_penalty,
            "presence_penalty": opts.presence_penalty,
            "min_tokens": opts.min_tokens,
            "ignore_eos": opts.ignore_eos,
            "stream": rng.random() < 0.5,
        }
        if opts.HasField("seed"):
            body["seed"] = opts.seed
        if opts.logit_bias:
            body["logit_bias"] = {str(k): v for k, v in opts.logit_bias.items()}
        r = requests.post(f"{self.http_url}/v1/completions", json=body, timeout=300)
        outage = self._in_outage(began)
        if r.status_code != 200:
            if r.status_code == 503 and outage:
                self._unavailable()
            else:
                self.add("http failed", f"HTTP {r.status_code}: {r.text[:200]}")
            return
        if body["stream"]:
            lines = [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: ")]
            if outage and any('"code":503' in ln for ln in lines):
                self._unavailable()
                return
            ok = bool(lines) and lines[-1] == "[DONE]" and all('"error"' not in ln for ln in lines)
            reasons = [c["finish_reason"] for ln in lines[:-1] for c in json.loads(ln)["choices"] if c["finish_reason"]]
        else:
            choices = r.json()["choices"]
            ok = len(choices) == opts.n
            reasons = [c["finish_reason"] for c in choices]
        ok = ok and len(reasons) == opts.n and set(reasons) <= {"stop", "length"}
        self.add("http finished", None if ok else f"bad HTTP result: {r.text[:4000]}")
