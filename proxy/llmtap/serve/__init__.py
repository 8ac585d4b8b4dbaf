"""Start-up and supervision: the process tree of ``llmtap serve``, and the in-process assembly of the others.

It binds the listeners, runs the event loops and uvicorn, starts and watches the telemetry processes and the
relays, names them and says where everything listens. It imports the relay (``llmtap.relay``) and the
telemetry side (``llmtap.telemetry``); neither imports it, nor each other.

* ``run``: ``llmtap serve``, the parent process;
* ``relay``: the relay process (one in the parent, or each of ``--workers``), ``workers`` their supervisor;
* ``telemetry``: the telemetry processes, started, watched and restarted; their entry point;
* ``server``: uvicorn and the event loop, shared by both kinds of process; ``sockets``: binding;
* ``local``: the relay and the telemetry side in one process (tests, the demo, benchmarks);
* ``lines``: what ``llmtap serve`` says once it listens.
"""
