"""API keys of the public APIs and the tenant they identify.

Keys come from `--api-keys` (comma list) and/or `--api-keys-file` (one per line, `#` comments). With no key
configured the APIs are open and every caller is the anonymous tenant "". A caller presents its key as
`authorization: Bearer KEY` or `x-api-key: KEY` (gRPC metadata or HTTP headers). The tenant id is a digest of the
key, never the key itself: it is what travels to the scheduler (ownership of requests, for Abort) and what salts
the prefix cache with `--prefix-cache-isolation api-key`.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable
from pathlib import Path

from services.frontend.request import ErrorCode, RequestError

ANONYMOUS = ""


def tenant_of(key: str) -> str:
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:24]


def read_keys(inline: str | None, path: str | None) -> list[str]:
    keys = [k.strip() for k in (inline or "").split(",") if k.strip()]
    if path:
        for line in Path(path).read_text().splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                keys.append(line)
    return keys


class ApiKeys:
    def __init__(self, keys: Iterable[str]) -> None:
        self._keys = sorted(set(keys))

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def tenant(self, headers: Iterable[tuple[str, str | bytes]] | None) -> str:
        """The caller's tenant; RequestError(UNAUTHENTICATED) when keys are on and none of them was presented."""
        if not self._keys:
            return ANONYMOUS
        presented = _presented_key(headers)
        if presented is None:
            raise RequestError(
                ErrorCode.UNAUTHENTICATED, "an API key is required: send 'authorization: Bearer KEY' or 'x-api-key'"
            )
        # NOTE: constant-time comparison against every key, so timing does not reveal a matching prefix.
        match = [k for k in self._keys if hmac.compare_digest(k.encode(), presented.encode())]
        if not match:
            raise RequestError(ErrorCode.UNAUTHENTICATED, "the API key is not valid")
        return tenant_of(match[0])


def _presented_key(headers: Iterable[tuple[str, str | bytes]] | None) -> str | None:
    for key, value in headers or ():
        k = key.lower()
        v = value.decode(errors="replace") if isinstance(value, bytes) else value
        if k == "authorization" and v[:7].lower() == "bearer ":
            return v[7:].strip()
        if k == "x-api-key":
            return v.strip()
    return None
