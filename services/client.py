"""A small Python client of the public Generation service (used by `pagoda generate`, tests and benchmarks)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc

from services.common.grpc_opts import CHANNEL_OPTIONS
from services.rpc import common_pb2, generation_pb2, generation_pb2_grpc


@dataclass
class Completion:
    """One choice, accumulated from a stream."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""


@dataclass
class GenerationResult:
    request_id: str
    choices: list[Completion]
    final: generation_pb2.FinalResult | None


class GenerationClient:
    def __init__(self, addr: str) -> None:
        self.addr = addr
        self.channel = grpc.insecure_channel(addr, options=CHANNEL_OPTIONS)
        self.stub = generation_pb2_grpc.GenerationStub(self.channel)

    def stream(
        self, request: generation_pb2.GenerateRequest, metadata: tuple[tuple[str, str], ...] | None = None
    ) -> Iterator[generation_pb2.GenerateResponse]:
        return self.stub.Generate(request, metadata=metadata)

    def generate(self, request: generation_pb2.GenerateRequest) -> GenerationResult:
        choices: dict[int, Completion] = {}
        rid, final = "", None
        for msg in self.stream(request):
            rid = msg.request_id
            for d in msg.choices:
                c = choices.setdefault(d.index, Completion(d.index))
                c.text += d.text
                c.token_ids.extend(d.token_ids)
                if d.finish_reason:
                    c.finish_reason = common_pb2.FinishReason.Name(d.finish_reason)
            if msg.HasField("final"):
                final = msg.final
        return GenerationResult(rid, [choices[i] for i in sorted(choices)], final)

    def model_info(self) -> generation_pb2.ModelInfoResponse:
        return self.stub.ModelInfo(generation_pb2.ModelInfoRequest(), timeout=10.0)

    def abort(self, request_id: str) -> bool:
        return self.stub.Abort(common_pb2.AbortRequest(request_id=request_id), timeout=10.0).found

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> GenerationClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def text_request(
    prompt: str, max_tokens: int = 64, temperature: float = 0.0, chat: bool = False, **sampling: object
) -> generation_pb2.GenerateRequest:
    """A GenerateRequest for a text prompt (or, with `chat`, a single user message)."""
    opts = common_pb2.SamplingOptions(max_tokens=max_tokens, temperature=temperature, **sampling)  # type: ignore[arg-type]
    if chat:
        messages = [generation_pb2.ChatMessage(role="user", content=prompt)]
        return generation_pb2.GenerateRequest(chat=generation_pb2.ChatInput(messages=messages), sampling=opts)
    return generation_pb2.GenerateRequest(text=prompt, sampling=opts)
