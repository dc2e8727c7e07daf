"""Process signals: SIGTERM/SIGINT start a graceful drain instead of killing the process."""

from __future__ import annotations

import asyncio
import signal


def shutdown_event() -> asyncio.Event:
    """An event set by SIGTERM or SIGINT (Kubernetes sends SIGTERM, then SIGKILL after the grace period)."""
    event = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, event.set)
    return event


def ignore_late_signals() -> None:
    """After a completed drain: a second SIGTERM/SIGINT (e.g. Ctrl-C reaching the whole process group, then the
    launcher's own SIGTERM) must not turn a clean exit into death by signal."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
