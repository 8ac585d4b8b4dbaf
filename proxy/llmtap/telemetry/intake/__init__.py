"""Intake: the relays' messages, from the channel to a finished timeline.

Each stream's segments and end are played back read by read (``replay``, ``tap``), the streams open at once and
those the full queue turned away are kept bounded (``streams``, ``holes``), and each relay's report becomes its
gauges, readiness and dropped tapes (``relays``).
"""
