"""Pure functions over finished requests: summary, estimator, cache diagnosis, fingerprints, compare."""
