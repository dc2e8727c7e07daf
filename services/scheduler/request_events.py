"""What the engine loop publishes: per request, what one step (or command) did to it (`RequestEvent`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from engine_core.core.request import Request
from engine_core.core.seq_output import SeqOutput

RequestTimes = tuple[float | None, float | None, float | None]  # first scheduled, first token, finished


@dataclass
class RequestEvent:
    """What one step (or command) did to one request."""

    request_id: str
    outputs: list[SeqOutput] = field(default_factory=list)
    finished: bool = False
    error: str = ""
    # The gRPC status that ends the request's stream when it failed: UNAVAILABLE (retryable: a worker failed or
    # hung) or INTERNAL (this request's handling raised).
    error_code: str = ""
    # The engine request this event belongs to: a stale event never reaches a newer request that reuses the id.
    request: Request | None = None
    # The request's times (this process's time.monotonic(), None: not yet), converted to Unix time only on the
    # messages that carry them (when one changed).
    times: RequestTimes = (None, None, None)


Publish = Callable[[list[RequestEvent]], None]
Events = dict[Request, RequestEvent]


def event_for(events: Events, request: Request) -> RequestEvent:
    """The event of this request object. NOTE: keyed by object, not id: an aborted request and a new one that
    reuses its id in the same iteration get separate events (one ABORT, one running)."""
    event = events.get(request)
    if event is None:
        event = events[request] = RequestEvent(request.request_id, request=request)
    return event
