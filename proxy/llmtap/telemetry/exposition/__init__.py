"""Exposition: the proxy's own metrics in Prometheus's text format (``/metrics``), from a pull-based reader."""
