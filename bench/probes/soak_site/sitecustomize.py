"""Loaded by every Python process of the memory soak's ``llmtap serve`` tree (first on its ``PYTHONPATH``): the
probe of ``bench.probes.soak_probe``, which does nothing unless ``SOAK_PROBE_DIR`` is set."""

from bench.probes.soak_probe import start

start()
