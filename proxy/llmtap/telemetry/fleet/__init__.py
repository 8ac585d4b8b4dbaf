"""Fleet: the others this telemetry process deals with beside its relays.

The upstreams (their own spans and the wait for them, ``serverspans``; their gauges, ``upstreams``; whether they
take a connection, ``reach``; their spans passed on to the traces backend, ``forward``), the other replicas
(``peers``) and the other telemetry processes of this one (``siblings``).
"""
