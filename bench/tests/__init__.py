"""The benchmark's own tests: its arithmetic, its command lines, and a small run of each measurement."""
