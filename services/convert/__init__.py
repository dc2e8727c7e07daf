"""Conversions between engine_core's typed dataclasses and the Protobuf messages between services."""
