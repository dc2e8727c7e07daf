"""Pieces every service shares: flags and environment, logging, health, signals, trace context, time."""
