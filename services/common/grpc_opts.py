"""Channel and server options shared by the services."""

from __future__ import annotations

# NOTE: the biggest internal message is a step whose new sequences carry their full prompts: at most
# max_num_seqs x max_model_len token ids (128 x 8192 x ~5 bytes = 5 MiB) plus their sampling options (stop strings
# never travel there). 64 MiB leaves ample room without letting one peer make a process buffer 256 MiB messages.
INTERNAL_MAX_MESSAGE_BYTES = 64 << 20

CHANNEL_OPTIONS: list[tuple[str, int]] = [
    ("grpc.max_send_message_length", INTERNAL_MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", INTERNAL_MAX_MESSAGE_BYTES),
    # NOTE: keepalive pings notice a dead peer (a killed pod) on otherwise idle streams.
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    # NOTE: a restarted peer (scheduler, worker) is reached again within seconds, not after gRPC's default backoff
    # of up to 120 s; calls meanwhile fail fast with UNAVAILABLE (no wait_for_ready).
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.min_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 2_000),
]


def server_options(max_receive_bytes: int = INTERNAL_MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    """The public frontend passes its `--max-request-bytes`; internal services keep the internal bound."""
    return [
        ("grpc.max_send_message_length", INTERNAL_MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", max_receive_bytes),
        ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.so_reuseport", 0),  # NOTE: a second server on a taken port must fail, not silently share it
    ]


SERVER_OPTIONS = server_options()
