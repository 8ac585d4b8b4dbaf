"""llmtap's Grafana dashboards, generated from code (``python -m dashboards.build``)."""
