"""The telemetry process: tapes in from the relays, spans, metrics, records and the admin listener out.

``llmtap serve`` starts it before the relays (``llmtap.serve.telemetry``, which also runs its admin listener
under uvicorn), its workers at SCHED_IDLE and its main thread niced (``llmtap.telemetry.sched``), so that on a
shared core the relays get the CPU first. It listens on a private Unix socket for the relays' channels
(``llmtap.relay.channel``), hands every message to the recorder's bounded queue (a full queue drops the
message and counts its tape), and serves the admin application (``/metrics``, ``/healthz``, ``/readyz``, the
live view) on the public admin port, whose socket the parent bound and passed down. It runs no relay code at
all: nothing it does, not even a 10 MB ``/metrics`` page or a slow collector, can delay a relayed byte.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import socket
import struct
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from llmtap.config.types import ConfigError, Settings
from llmtap.deadline import Deadline
from llmtap.telemetry import identity, sched
from llmtap.wire.framing import FrameReader
from llmtap.wire.messages import Raw, ready_of

if TYPE_CHECKING:
    from llmtap.telemetry.admin.connections import AdminLimits
    from llmtap.telemetry.admin.server import AdminApp
    from llmtap.telemetry.fleet.siblings import Siblings
    from llmtap.telemetry.journal.spool import Spool
    from llmtap.telemetry.recorder import Recorder

__all__ = ["INTAKE_SLICE", "Launch", "Receiver", "peer_pid", "prepare", "running"]

log = logging.getLogger("llmtap.telemetry")

#: ``struct ucred``: pid, uid, gid.
_UCRED = struct.Struct("3i")
#: The source the recorder sees the sibling processes' lessons come from (relays are 0 and up).
LESSONS = -2


@dataclass(frozen=True, slots=True)
class Launch:
    """What the parent passes down: settings, the sockets' descriptors, how many relays to expect, and
    the pipe on which to say that it started (``ready``) or why it cannot (``error: ...``)."""

    settings: Settings
    channel_fd: int
    admin_fd: int
    relays: int
    started_fd: int
    #: Which telemetry process this is, and (process 0 only) the admin sockets of the others.
    index: int = 0
    peers: tuple[str, ...] = ()
    #: With several processes: the socket this one takes the others' lessons on, and every process's, by index
    #: (``llmtap.telemetry.fleet.siblings``); -1 and none for one process.
    facts_fd: int = -1
    siblings: tuple[str, ...] = ()


class Receiver(Protocol):
    """What a relay's channel hands its messages to: the recorder (a test's stand-in is a few lines)."""

    @property
    def spool(self) -> Spool | None:
        """The record journal each read goes to first (None: not kept)."""

    def submit(self, message: Raw, source: int = 0) -> bool:
        """Queue one encoded message; False when the queue is full."""

    def submit_all(self, messages: Sequence[Raw], source: int = 0) -> None:
        """Queue every message of one read, in order (the worker woken once)."""

    def relay_ready(self, source: int, ready: bool) -> None:
        """The relay reported its readiness."""

    def relay_gone(self, source: int) -> None:
        """The relay disconnected."""


#: Bytes of a relay's read decoded before the next look at the relays (``sched.checkpoint``). A relay gathers its
#: tapes (``telemetry_gather``) and writes them at once: a read of 256 KiB holds about 400 short requests' tapes,
#: about a millisecond of ``marshal`` and the collections it sets off on this thread (in the normal class, niced,
#: under ``idle`` too), which a relay woken meanwhile waited out. 32 KiB is about 50 such tapes, 0.15 ms: the
#: looks come every ``telemetry_yield`` of work here as elsewhere.
INTAKE_SLICE = 32 * 1024


class _Intake(asyncio.Protocol):
    """One relay's channel: length-prefixed messages into the recorder's queue."""

    def __init__(self, recorder: Receiver, source: int, connected: set[int]) -> None:
        self.recorder = recorder
        self.source = source
        self.connected = connected
        # The record journal keeps what each read gave, before the recorder's queue: a kill of this process
        # loses none of it (``llmtap.telemetry.journal.spool``).
        self._spool = recorder.spool
        self._frames = FrameReader(keep=self._spool is not None)
        self._transport: asyncio.BaseTransport | None = None
        self._pid = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """A relay connected: its process is watched, so that telemetry yields the core when it waits."""
        self._transport = transport
        self.connected.add(self.source)
        self._pid = peer_pid(transport)
        if self._pid:
            sched.watch(self._pid)

    def data_received(self, data: bytes) -> None:
        """Take every complete message, ``INTAKE_SLICE`` bytes of the read at a time with a look at the relays between
        (``sched.checkpoint``); the recorder counts what its full queue cannot take."""
        for at in range(0, len(data), INTAKE_SLICE):
            if at:
                sched.checkpoint()
            self._take(data[at : at + INTAKE_SLICE] if len(data) > INTAKE_SLICE else data)
        if self._frames.broken is not None and self._transport is not None:
            # Only relays of this server can connect (the socket is private): a bad frame is a bug. Nothing after
            # it can be read, so the connection goes (said once); the relay connects again.
            log.error("telemetry: relay %d sent %s; its connection is reset", self.source, self._frames.broken)
            self._transport.close()
            self._transport = None

    def _take(self, data: bytes) -> None:
        """The complete messages ``data`` ends, journalled and queued together (the worker woken once for them)."""
        messages = self._frames.feed(data)
        if self._spool is not None and messages:
            self._spool.append(self.source, self._frames.taken, messages)
        for message in messages:
            sched.checkpoint()
            ready = ready_of(message)
            if ready is not None:
                # Readiness is read here, not after the queue: /readyz follows a drain's start at once.
                self.recorder.relay_ready(self.source, ready)
        self.recorder.submit_all(messages, self.source)

    def connection_lost(self, exc: Exception | None) -> None:
        """The relay went away: its gauges drop to zero."""
        self.connected.discard(self.source)
        self.recorder.relay_gone(self.source)
        if self._spool is not None:
            self._spool.source_gone(self.source)
        if self._pid:
            sched.forget(self._pid)


def peer_pid(transport: asyncio.BaseTransport) -> int:
    """The process on the other end of a Unix socket (``SO_PEERCRED``), 0 when unknown (another PID namespace)."""
    sock = transport.get_extra_info("socket")
    try:
        cred = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    except (AttributeError, OSError):
        return 0
    pid: int = _UCRED.unpack(cred)[0]
    return pid


class _Lessons(asyncio.Protocol):
    """Another telemetry process's lessons (``llmtap.telemetry.fleet.siblings``) into the recorder's queue."""

    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder
        self._frames = FrameReader()
        self._transport: asyncio.BaseTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """A sibling connected."""
        self._transport = transport

    def data_received(self, data: bytes) -> None:
        """Every complete message to the queue (a full queue drops and counts its lessons)."""
        for message in self._frames.feed(data):
            self.recorder.submit(message, LESSONS)
        if self._frames.broken is not None and self._transport is not None:
            log.error("telemetry: a sibling process sent %s; its connection is reset", self._frames.broken)
            self._transport.close()
            self._transport = None


class TelemetryState:
    """What the admin listener reads here: the recorder, and whether every relay is connected and ready."""

    def __init__(self, recorder: Recorder, settings: Settings, relays: int, connected: set[int]) -> None:
        self.recorder: Recorder | None = recorder
        self.settings = settings
        self._relays = relays
        self._connected = connected
        self._recorder = recorder

    @property
    def ready(self) -> bool:
        """Ready when as many relays as expected are connected, and each said it is ready."""
        ready = self._recorder.relays_ready
        return len(self._connected) >= self._relays and all(ready.get(s, False) for s in self._connected)

    @property
    def ready_detail(self) -> str:
        """How many relays are connected and ready, of how many expected."""
        ready = sum(1 for s in self._connected if self._recorder.relays_ready.get(s, False))
        return f"{ready}/{self._relays} relays"


@dataclass(frozen=True, slots=True)
class Running:
    """A telemetry process taking tapes: the admin application to serve on ``admin_sock``, within ``limits``."""

    admin: AdminApp
    limits: AdminLimits
    admin_sock: socket.socket


def prepare(launch: Launch) -> None:
    """Before the loop and any thread start: this process's OTLP identity, and its scheduling.

    Threads started later inherit the main thread's nice value, so the scheduling is applied first.
    """
    several = launch.settings.telemetry_workers > 1
    if several or identity.configured_instance_id() is None:
        # One OTLP identity per process: cumulative series of two processes must not look like one, and the
        # records this process writes carry the same id (``llmtap.telemetry.identity``).
        extra = f"{identity.INSTANCE_KEY}={identity.own_instance_id()}"
        if several:
            extra += f",llmtap.telemetry.worker={launch.index}"
        attrs = os.environ.get(identity.RESOURCE_ENV, "")
        os.environ[identity.RESOURCE_ENV] = f"{attrs},{extra}" if attrs else extra
    got = sched.apply(launch.settings.telemetry_scheduling, launch.settings.telemetry_yield)
    if got != launch.settings.telemetry_scheduling:
        log.info("telemetry: scheduling %s not permitted here; running %s", launch.settings.telemetry_scheduling, got)


@contextlib.asynccontextmanager
async def running(launch: Launch) -> AsyncIterator[Running]:
    """Take the relays' tapes while the body serves the admin application; then drain and flush.

    A setting only this process can check (the record file) is said to the parent, and exits with code 2.
    """
    # Only this process loads OpenTelemetry and the tokenizer.
    from llmtap.analysis import tokens
    from llmtap.telemetry.admin.connections import AdminLimits
    from llmtap.telemetry.admin.server import AdminApp
    from llmtap.telemetry.emit import setup
    from llmtap.telemetry.recorder import Recorder

    settings = launch.settings
    channel_sock = socket.socket(fileno=launch.channel_fd)
    admin_sock = socket.socket(fileno=launch.admin_fd)
    providers = setup.build(settings.telemetry)
    try:
        recorder = Recorder(
            settings,
            tracer_provider=providers.tracer_provider,
            meter_provider=providers.meter_provider,
            journal=launch.index,
        )
    except ConfigError as exc:
        _say(launch.started_fd, f"error: {exc}")
        raise SystemExit(2) from None
    gate = providers.span_gate
    if gate is not None:
        recorder.losses.watch("spans", lambda: dict(gate.dropped))
    # Load the default encoding before the first tape needs it.
    await asyncio.to_thread(tokens.get_encoding)
    connected: set[int] = set()
    sources = itertools.count()
    loop = asyncio.get_running_loop()
    intake = await loop.create_unix_server(
        lambda: _Intake(recorder, next(sources), connected), sock=channel_sock, start_serving=True
    )
    siblings, lessons = await _siblings(launch, recorder, loop)
    _say(launch.started_fd, "ready")
    sched.idle_others()  # the SDK's exporter threads and the executor's, all started by now
    state = TelemetryState(recorder, settings, launch.relays, connected)
    admin = AdminApp(state, providers.prometheus, peers=launch.peers)
    try:
        yield Running(admin, AdminLimits(settings, recorder.count_admin), admin_sock)
    finally:
        intake.close()
        # What the relays sent before they closed is in the queue: record it, then flush, all within the one bound
        # (a drain slowed by a busy machine leaves the exporters less time, never the exit more).
        deadline = Deadline(settings.timeouts.flush)
        await asyncio.to_thread(recorder.close, settings.timeouts.flush)
        if lessons is not None:
            lessons.close()
        if siblings is not None:
            await siblings.aclose()
        await asyncio.to_thread(providers.shutdown, deadline.left(), bound=settings.timeouts.flush)
        recorder.losses.tick(final=True)  # the spans the flush could not send, said with their count


async def _siblings(
    launch: Launch, recorder: Recorder, loop: asyncio.AbstractEventLoop
) -> tuple[Siblings | None, asyncio.Server | None]:
    """With several telemetry processes: the others, told what this one learns, and the server of what they tell."""
    from llmtap.telemetry.fleet.siblings import Siblings

    if launch.facts_fd < 0:
        return None, None
    siblings = Siblings(launch.siblings, launch.index, loop, recorder.count_facts_dropped)
    recorder.share_with(siblings)
    lessons = await loop.create_unix_server(
        lambda: _Lessons(recorder), sock=socket.socket(fileno=launch.facts_fd), start_serving=True
    )
    await siblings.start()
    return siblings, lessons


def _say(fd: int, line: str) -> None:
    """Tell the parent how the start went, once."""
    with contextlib.suppress(OSError):
        os.write(fd, line.encode() + b"\n")
        os.close(fd)
