"""The commands gRPC handlers queue for the engine thread, applied between steps (the EngineCore is not
thread-safe)."""

from __future__ import annotations

import queue
from dataclasses import dataclass

from engine_core.core.request import Request


@dataclass
class AddCommand:
    request: Request


@dataclass
class AbortCommand:
    request: Request  # NOTE: by object, not id: an abort never reaches a newer request that reuses the id


@dataclass
class FinishChoiceCommand:
    request: Request
    index: int
    stop: str


@dataclass
class StopCommand:
    pass


Command = AddCommand | AbortCommand | FinishChoiceCommand | StopCommand


class CommandQueue:
    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Command] = queue.SimpleQueue()

    def put(self, cmd: Command) -> None:
        self._queue.put(cmd)

    def take(self, block_s: float | None) -> list[Command]:
        """Every queued command; when idle (`block_s`), waits up to that long for the first one."""
        cmds: list[Command] = []
        if block_s is not None:
            try:
                cmds.append(self._queue.get(timeout=block_s))
            except queue.Empty:
                return cmds
        while True:
            try:
                cmds.append(self._queue.get_nowait())
            except queue.Empty:
                return cmds
