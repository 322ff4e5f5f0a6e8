"""A direct channel from a decode engine to a verify replica: pdv's verify calls without Ray's hops.

Through Ray, a verify call of an engine in a process of its own went engine process -> its replica
(socket) -> that replica's event loop -> Serve's router -> the verify replica's event loop, and its
answer the same way back. On an H200 that round trip took 14.8 ms of a 37.8 ms cycle whose verify
forward took 11.9 (docs/lanes_one_gpu.md). Only token ids and probabilities travel between the two
lanes, so the engine sends each batch straight to the verify replica that holds its rows' KV, over
a connection that replica opened (its address and key travel once through Ray), the way vLLM's
engine core and front end talk over ZMQ. The calls that change slots (allocate, commit, release)
stay on Ray, where the lease router and the slot owners keep their bookkeeping.

Either end going away shows at the other as the connection's end: the engine takes every call
waiting on it as lost KV (the requests are recomputed where a replica takes them, as on a lease
router's LeaseGone), and the verify replica stops reading.

With shared drafts (`shared_drafts`), an engine on the verify replica's device offers it, as the
channel's first call, a ring of device buffers for its drafts (lanes/device/shared_drafts.py). Once the
replica has mapped it, a batch's drafts travel as a slot of that ring instead of through the host.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import secrets
import socket
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from multiprocessing.connection import Client, Connection, Listener

import torch

from lanes.device.shared_drafts import DraftRing, RingHandle
from lanes.engine.backends import KVLost
from lanes.engine.process import picklable, put_message, take_message
from lanes.spec.verify import VerifyBatch, VerifyResult

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ChannelAddress:
    """Where a verify replica listens, and the key a client proves itself with (multiprocessing's
    HMAC challenge: a process that did not get the address through Ray cannot send batches)."""

    host: str
    port: int
    authkey: bytes = field(repr=False)


def _send(conn: Connection, lock: threading.Lock, message: tuple) -> None:
    with lock:  # one message at a time on a connection that several threads send on
        put_message(conn, message)


def _hang_up(conn: Connection) -> None:
    """End a connection whose reader may be blocked in it: a shutdown wakes that reader with the end
    of the stream (closing the descriptor would not), and the reader closes it."""
    try:
        with socket.fromfd(conn.fileno(), socket.AF_INET, socket.SOCK_STREAM) as sock:  # a duplicate descriptor
            sock.shutdown(socket.SHUT_RDWR)
    except OSError:  # closed already
        pass


class VerifyChannelServer:
    """In a verify replica: accepts decode engines' connections and answers each batch with
    `verify(batch)` run on the replica's event loop, where its batcher merges every caller's rows
    into one forward, whether they came over a channel or through Ray."""

    def __init__(self, verify: Callable[[VerifyBatch], Awaitable[VerifyResult]], loop: asyncio.AbstractEventLoop,
                 host: str, open_ring: Callable[[RingHandle], bool] = lambda handle: False,
                 close_ring: Callable[[str], None] = lambda ring_id: None):
        """`open_ring(handle)`: map an engine's ring of drafts, True if mapped; `close_ring(ring_id)`: unmap it
        once its engine's connection ends."""
        self._verify, self._loop = verify, loop
        self._open_ring, self._close_ring = open_ring, close_ring
        authkey = secrets.token_bytes(32)
        self._listener = Listener((host, 0), authkey=authkey)
        self.address = ChannelAddress(host, self._listener.address[1], authkey)
        self.num_calls = 0  # batches answered over channels (stats: whether the channel is in use)
        self._closed = False
        self._conns: set[Connection] = set()
        threading.Thread(target=self._accept, name="vpd-verify-channel", daemon=True).start()

    def close(self) -> None:
        """Stop listening and end every connection: the engines take what they wait for as lost."""
        self._closed = True
        try:  # wakes the accepting thread (closing the listener would not), which then sees it closed
            socket.create_connection((self.address.host, self.address.port), timeout=1.0).close()
        except OSError:
            pass
        self._listener.close()
        for conn in list(self._conns):
            _hang_up(conn)

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn = self._listener.accept()
            except Exception as exc:  # noqa: BLE001 - a client that failed the handshake; go on listening
                if self._closed:
                    return
                log.warning("verify channel: refused a connection: %s", exc)
                continue
            self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn,), name="vpd-verify-channel-conn", daemon=True).start()

    def _serve(self, conn: Connection) -> None:
        lock = threading.Lock()  # answers are sent from the event loop, in the order they finish
        rings = []
        try:
            while True:
                call_id, message = take_message(conn)
                if isinstance(message, RingHandle):  # the engine's offer of its ring, before its batches
                    mapped = self._open_ring(message)
                    rings += [message.ring_id] if mapped else []
                    _send(conn, lock, (call_id, True, mapped))
                    continue
                call = asyncio.run_coroutine_threadsafe(self._verify(message), self._loop)
                call.add_done_callback(partial(self._answer, conn, lock, call_id))
        except (EOFError, OSError):  # the engine is gone, or this server closed
            pass
        except Exception:  # noqa: BLE001 - a message that does not unpickle here: end this connection only
            log.exception("verify channel: a message failed; closing the connection")
        self._conns.discard(conn)
        conn.close()
        for ring_id in rings:
            self._close_ring(ring_id)

    def _answer(self, conn: Connection, lock: threading.Lock, call_id: int, call: concurrent.futures.Future) -> None:
        self.num_calls += 1
        try:
            result = call.result()
            if result.errors is not None:
                result.errors = [None if e is None else picklable(e) for e in result.errors]
            message = (call_id, True, result)
        except BaseException as exc:  # noqa: BLE001 - the caller's rows fail with it (a stale lease, ...)
            message = (call_id, False, picklable(exc))
        try:
            _send(conn, lock, message)
        except OSError:  # the engine went while its batch was verified
            pass


class VerifyChannel:
    """In a decode engine: one verify replica's connection, and the calls waiting on it. `send`
    returns a future that the reader thread settles with the replica's answer, or with KVLost when
    the connection ends first."""

    def __init__(self, lease: str, conn: Connection, on_close: Callable[[str], None]):
        self.lease = lease
        self._conn = conn
        self._on_close = on_close
        self._ring: DraftRing | None = None  # offered to the replica
        self._ring_mapped = False  # and mapped there
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        self._pending: dict[int, concurrent.futures.Future] = {}
        self._ids = itertools.count()
        self._closed = False
        threading.Thread(target=self._read, name=f"vpd-verify-channel-{lease[:8]}", daemon=True).start()

    @classmethod
    def connect(cls, lease: str, address: ChannelAddress, on_close: Callable[[str], None]) -> VerifyChannel:
        return cls(lease, Client((address.host, address.port), authkey=address.authkey), on_close)

    def ring(self, drafts: torch.Tensor, max_rows: int, width: int) -> DraftRing | None:
        """The ring that this batch's drafts can go by: the replica's mapped ring if they fit it. The first
        call offers the replica a ring of `max_rows` x `width` on the drafts' device; until it has mapped it,
        and for good if it does not (another device), None: the drafts go through the host."""
        if self._ring is None:
            self._ring = DraftRing(drafts.device, max_rows, width)
            self.send(self._ring.handle()).add_done_callback(self._ring_answered)
            return None
        return self._ring if self._ring_mapped and self._ring.fits(drafts) else None

    def _ring_answered(self, answer: concurrent.futures.Future) -> None:
        self._ring_mapped = answer.exception() is None and answer.result() is True
        if not self._ring_mapped:
            log.info("verify replica %s did not map this engine's ring of drafts; they go through the host",
                     self.lease)

    def send(self, batch: VerifyBatch | RingHandle) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            closed = self._closed
            if not closed:
                call_id = next(self._ids)
                self._pending[call_id] = future
        if closed:
            future.set_exception(self._lost())
            return future
        try:
            _send(self._conn, self._send_lock, (call_id, batch))
        except OSError:  # the replica went: the reader settles every waiting call
            _hang_up(self._conn)
        return future

    def close(self) -> None:
        _hang_up(self._conn)  # the reader sees the end, and settles what waits

    def _read(self) -> None:
        try:
            while True:
                call_id, ok, value = take_message(self._conn)
                with self._lock:
                    future = self._pending.pop(call_id, None)
                if future is not None and not future.done():
                    future.set_result(value) if ok else future.set_exception(value)
        except (EOFError, OSError):
            self._conn.close()
        with self._lock:
            self._closed = True
            pending, self._pending = self._pending, {}
        for future in pending.values():
            if not future.done():
                future.set_exception(self._lost())
        if self._ring is not None:
            self._ring.close()
        self._on_close(self.lease)

    def _lost(self) -> KVLost:
        return KVLost(f"verify replica {self.lease} closed its channel")


class VerifyChannels:
    """A decode engine's channels, by lease. `get(lease)` returns the lease's open channel, or None
    and, the first time, asks for its address with `ask(lease, on_address)` (through the engine's
    replica, which reaches the verify replica on Ray); the channel opens when that answer comes, on
    a thread of its own, and the calls of the meantime go through Ray."""

    def __init__(self, ask: Callable[[str, Callable[[object], None]], None]):
        self._ask = ask
        self._open: dict[str, VerifyChannel] = {}
        self._asked: set[str] = set()
        self._lock = threading.Lock()

    def get(self, lease: str) -> VerifyChannel | None:
        with self._lock:
            if (channel := self._open.get(lease)) is not None:
                return channel
            first = lease not in self._asked
            self._asked.add(lease)
        if first:
            self._ask(lease, partial(self._answered, lease))
        return None

    def close(self) -> None:
        with self._lock:
            channels = list(self._open.values())
        for channel in channels:
            channel.close()

    def _answered(self, lease: str, address) -> None:
        if isinstance(address, BaseException) or address is None:
            # The replica is gone or refused: its calls go through Ray, which says so (LeaseGone).
            log.info("no verify channel to %s: %s", lease, address)
            return
        threading.Thread(target=self._connect, args=(lease, address), name="vpd-verify-connect", daemon=True).start()

    def _connect(self, lease: str, address: ChannelAddress) -> None:
        try:
            channel = VerifyChannel.connect(lease, address, self._forget)
        except Exception as exc:  # noqa: BLE001 - unreachable (another node's firewall): Ray carries its calls
            log.warning("verify channel to %s at %s:%d failed (%s); its calls go through Ray", lease,
                        address.host, address.port, exc)
            return
        with self._lock:
            self._open[lease] = channel

    def _forget(self, lease: str) -> None:
        # Gone with its replica, most likely: later calls go through Ray, which answers LeaseGone for
        # a replica that is gone, and a new channel is asked for one that is not.
        with self._lock:
            self._open.pop(lease, None)
            self._asked.discard(lease)
