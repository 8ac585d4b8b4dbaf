"""The benchmark: what a proxy adds to TTFT and chunk gaps, side by side with nginx and LiteLLM, and how
accurate llmtap's own figures are against aiperf and Prometheus. ``python -m bench --help``."""
