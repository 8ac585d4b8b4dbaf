"""Telemetry: the only package that imports OpenTelemetry."""
