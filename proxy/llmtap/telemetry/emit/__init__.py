"""Emit: a finished request turned into OpenTelemetry output, each emitter reading it once.

The finished request and the emitter protocol (``finished``), the spans (``spans``, ``attributes``,
``chunkdetail``, ``otlp_spans``), the metrics (``metrics``, ``instruments``, ``bulk``) and the providers and
exporters they go out through (``setup``); records as OTLP log records are the records room's
(``llmtap.telemetry.records.logs``).
"""
