"""Records: each finished request's record line, built once (``record``), and the sinks it goes to (``sinks``):
the record files (``dataset``), ClickHouse (``clickhouse``), and the access log (``access_log``).

``emitter`` is the records' emitter: it hands the line to every sink and tells the record journal which has it.
"""
