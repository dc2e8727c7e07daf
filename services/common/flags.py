"""Command-line flags that fall back to PAGODA_* environment variables (for Kubernetes pods), then defaults."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any


def env_name(flag: str) -> str:
    """`--scheduler-addr` -> `PAGODA_SCHEDULER_ADDR`."""
    return "PAGODA_" + flag.lstrip("-").replace("-", "_").upper()


def _parse_bool(value: str) -> bool:
    v = value.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off", ""):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean, got {value!r}")


def add_flag(
    parser: argparse.ArgumentParser,
    flag: str,
    *,
    default: Any,
    type: Callable[[str], Any] = str,
    help: str,
) -> None:
    """A flag whose default comes from its environment variable when set (the flag itself still wins)."""
    env = env_name(flag)
    raw = os.environ.get(env)
    value = default
    if raw is not None:
        try:
            value = _parse_bool(raw) if type is bool else type(raw)
        except (ValueError, argparse.ArgumentTypeError) as e:
            parser.error(f"{env}={raw!r}: {e}")
    if type is bool:
        parser.add_argument(flag, type=_parse_bool, nargs="?", const=True, default=value, help=f"{help} [{env}]")
    else:
        parser.add_argument(flag, type=type, default=value, help=f"{help} (default {default!r}) [{env}]")


def optional_int(value: str) -> int | None:
    return None if value.strip().lower() in ("", "none", "auto") else int(value)


def optional_str(value: str) -> str | None:
    return value or None


def optional_float(value: str) -> float | None:
    return None if value.strip().lower() in ("", "none", "auto") else float(value)
