"""Admin: the telemetry process's own listener (``server``: health, readiness, the span receiver, ``/metrics``),
its connections (``connections``), who may use what (``access``), and the live view (``live``).
"""
