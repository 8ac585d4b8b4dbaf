"""The relay process: what must happen while bytes flow, and nothing else."""
