"""Request ids are scoped by tenant: the id a request has inside the services is (tenant, client request_id).

Tenants are `services.frontend.auth` digests ("key-<hex>", or "" when API keys are off): they never contain '/', so
`tenant/request_id` is unambiguous whatever the client's id holds. Two tenants may use the same request_id at once;
neither can tell whether the other's id exists (no ALREADY_EXISTS oracle, no squatting), and Abort and FinishChoice
only reach the caller's own request. The client always sees the id it sent.
"""

from __future__ import annotations

SEPARATOR = "/"


def check_tenant(tenant: str) -> None:
    """ValueError naming the field when `tenant` could make a scoped id ambiguous."""
    if SEPARATOR in tenant:
        raise ValueError(f"owner must not contain {SEPARATOR!r}")


def scoped_request_id(tenant: str, request_id: str) -> str:
    """The services' id of a client's request: unique across tenants (the engine and the frontend's output
    processor key requests by it)."""
    return f"{tenant}{SEPARATOR}{request_id}"
