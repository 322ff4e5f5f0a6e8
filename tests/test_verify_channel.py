"""pdv's engine sends its verify batches straight to the verify replicas (deployments/channels/verify_channel.py):
each replica's rows over its own channel once the engine has it, through the engine's replica before;
a channel that ends or goes silent costs its rows a recompute (KVLost), never a failure or a hang.

The verify replicas here are channel servers on an event loop of their own, as in a replica; their
verify answers each row with its drafts and its slot (accept all), so that the test sees which rows
reached which replica. The engine's replica is `_Relay`: it answers what an engine process sends it
(lanes/engine/process.py PeerLink) from the same replicas, as deployments/channels/peer_calls.py does on Ray."""

import asyncio
import threading
import time
from dataclasses import replace
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client

import pytest
import torch

from deployments.channels.remote import ChannelOrder, LinkedVerifier, VerifyOrder, merge_rows, rows_by_lease
from deployments.channels.verify_channel import VerifyChannelServer
from lanes.device.shared_drafts import DraftRef, OpenRing, RingHandle, can_open
from lanes.engine.backends import KVLost
from lanes.kv.pool import PoolFullError
from lanes.sample.params import SamplingParams
from lanes.spec.verify import VerifyBatch, VerifyResult


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)


class _Replica:
    """A verify replica's channel and what it verified; `hold` keeps its answers back until set."""

    def __init__(self, lease: str, loop: asyncio.AbstractEventLoop, maps_rings: bool = False):
        """`maps_rings`: it maps an engine's ring of drafts, as a verify replica on the engine's device does."""
        self.lease = lease
        self.rows_seen: list[int] = []
        self.hold = threading.Event()
        self.hold.set()
        self.shed_slots: set[int] = set()  # rows it sheds for want of blocks
        self.maps_rings = maps_rings
        self.rings: dict[str, OpenRing] = {}
        self.ring_batches = 0  # batches whose drafts came in a ring
        self.server = VerifyChannelServer(self.verify, loop, "127.0.0.1", self._open_ring, self._close_ring)

    def _open_ring(self, handle: RingHandle) -> bool:
        if self.maps_rings and can_open(handle, torch.device("cpu")):
            self.rings[handle.ring_id] = OpenRing(handle)
        return handle.ring_id in self.rings

    def _close_ring(self, ring_id: str) -> None:
        self.rings.pop(ring_id).close()

    async def verify(self, batch: VerifyBatch) -> VerifyResult:
        if isinstance(batch.draft_tokens, DraftRef):
            self.ring_batches += 1
            batch = replace(batch, draft_tokens=self.rings[batch.draft_tokens.ring_id].take(batch.draft_tokens))
        assert all(lease == self.lease for lease in batch.target_leases)
        while not self.hold.is_set():
            await asyncio.sleep(0.01)
        self.rows_seen += batch.target_slots
        tokens = [row.tolist() + [slot] for row, slot in zip(batch.draft_tokens, batch.target_slots)]
        errors = [PoolFullError("no free KV blocks") if s in self.shed_slots else None for s in batch.target_slots]
        return VerifyResult(tokens, [len(t) - 1 for t in tokens], None, errors if any(errors) else None)


class _Relay:
    """The engine's replica (the link an engine process has): answers a ChannelOrder with the
    replica's address and a relayed VerifyOrder from the replicas by lease, on their loop."""

    def __init__(self, replicas: dict[str, _Replica], loop: asyncio.AbstractEventLoop):
        self.replicas, self.loop = replicas, loop
        self.relayed_rows = 0
        self.records: list[tuple] = []

    def call(self, order, on_done) -> None:
        if isinstance(order, ChannelOrder):
            replica = self.replicas.get(order.lease)
            on_done(replica.server.address if replica is not None else KVLost(f"{order.lease} is gone"))
        elif isinstance(order, VerifyOrder):
            self.relayed_rows += len(order.batch.target_slots)
            asyncio.run_coroutine_threadsafe(self._verify(order.batch), self.loop).add_done_callback(
                lambda call: on_done(call.exception() or call.result()))

    async def _verify(self, batch: VerifyBatch) -> VerifyResult:
        by_lease = rows_by_lease(batch)
        parts = [(rows, await self.replicas[lease].verify(batch.select(rows))) for lease, rows in by_lease.items()]
        return merge_rows(len(batch.target_slots), parts)

    def record(self, kind: str, start_s: float, end_s: float, **info) -> None:
        self.records.append((kind, start_s, end_s, info))


def _batch(leases: list[str]) -> VerifyBatch:
    rows = len(leases)
    return VerifyBatch(list(range(rows)), [5] * rows, [1] * rows, torch.arange(rows * 2).view(rows, 2), None,
                       [2] * rows, [SamplingParams(temperature=0)] * rows, [0] * rows, target_leases=leases)


def _expected(leases: list[str]) -> list[list[int]]:
    return [[2 * row, 2 * row + 1, row] for row in range(len(leases))]


def _wait_for(check, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_rows_go_over_their_replicas_channel_once_it_is_open_and_through_the_replica_before(loop):
    replicas = {lease: _Replica(lease, loop) for lease in ("a", "b")}
    relay = _Relay(replicas, loop)
    verifier = LinkedVerifier(relay, timeout_s=5.0)
    leases = ["a", "b", "a", "b", "a"]
    first = verifier.launch(_batch(leases)).result()  # no channel yet: all relayed, and both asked for
    assert first.tokens == _expected(leases) and relay.relayed_rows == 5
    _wait_for(lambda: all(verifier.channels.get(lease) is not None for lease in replicas))
    second = verifier.launch(_batch(leases)).result()
    assert second.tokens == _expected(leases) and second.num_accepted == [2] * 5 and second.errors is None
    assert relay.relayed_rows == 5  # nothing more went through the engine's replica
    assert replicas["a"].server.num_calls == 1 and replicas["b"].server.num_calls == 1
    assert sorted(replicas["a"].rows_seen) == [0, 0, 2, 2, 4, 4] and sorted(replicas["b"].rows_seen) == [1, 1, 3, 3]
    assert [r[0] for r in relay.records] == ["verify_wait", "verify_wait"] and relay.records[1][3] == {"rows": 5}


def test_drafts_go_in_the_ring_a_replica_mapped_and_through_the_host_to_one_that_did_not(loop):
    """lanes/device/shared_drafts.py: an engine offers each replica a ring with its first batch over the
    channel; "a" maps it (on the engine's device) and "b" does not (another device). Once "a" has, its rows'
    drafts go in the ring, "b"'s still through the host, and every row's answer is the same either way. The
    ring goes when the engine's channel ends."""
    replicas = {"a": _Replica("a", loop, maps_rings=True), "b": _Replica("b", loop)}
    verifier = LinkedVerifier(_Relay(replicas, loop), timeout_s=5.0, shared_drafts=(8, 4))
    leases = ["a", "b", "a", "b", "a"]
    assert verifier.launch(_batch(leases)).result().tokens == _expected(leases)  # relayed; channels asked for
    _wait_for(lambda: all(verifier.channels.get(lease) is not None for lease in replicas))
    assert verifier.launch(_batch(leases)).result().tokens == _expected(leases)  # rings offered; host meanwhile
    _wait_for(lambda: verifier.channels.get("a")._ring_mapped)
    assert verifier.channels.get("b").ring(torch.zeros(1, 1, dtype=torch.long), 8, 4) is None  # refused
    third = verifier.launch(_batch(leases)).result()
    assert third.tokens == _expected(leases) and third.num_accepted == [2] * 5
    assert (replicas["a"].ring_batches, replicas["b"].ring_batches) == (1, 0)
    # Rows past the ring's size, sampled drafts' probabilities: through the host.
    wide = _batch(["a"] * 9)
    assert verifier.launch(wide).result().tokens == _expected(["a"] * 9)
    sampled = replace(_batch(["a"]), draft_probs=torch.full((1, 2, 4), 0.25))
    assert verifier.launch(sampled).result().tokens == _expected(["a"])
    assert replicas["a"].ring_batches == 1
    verifier.channels.close()
    _wait_for(lambda: not replicas["a"].rings)


def test_a_replicas_shed_rows_keep_their_error_over_the_channel(loop):
    replicas = {"a": _Replica("a", loop)}
    replicas["a"].shed_slots = {1}
    verifier = LinkedVerifier(_Relay(replicas, loop), timeout_s=5.0)
    verifier.launch(_batch(["a"])).result()
    _wait_for(lambda: verifier.channels.get("a") is not None)
    result = verifier.launch(_batch(["a", "a", "a"])).result()
    assert replicas["a"].server.num_calls == 1
    assert result.errors[0] is None and isinstance(result.errors[1], PoolFullError) and result.errors[2] is None
    assert result.tokens[0] == [0, 1, 0] and result.tokens[2] == [4, 5, 2]


def test_a_channel_that_ends_loses_its_waiting_rows_and_later_rows_go_through_the_replica(loop):
    """The verify replica went (its server closed every connection) while a batch of its rows was in a
    forward: those rows come back as lost KV, which the engine recomputes elsewhere (EngineCore._migrate);
    another replica's rows of the same batch are verified; the next batch goes through Ray."""
    replicas = {lease: _Replica(lease, loop) for lease in ("a", "b")}
    relay = _Relay(replicas, loop)
    verifier = LinkedVerifier(relay, timeout_s=5.0)
    verifier.launch(_batch(["a", "b"])).result()
    _wait_for(lambda: all(verifier.channels.get(lease) is not None for lease in replicas))
    replicas["a"].hold.clear()
    pending = verifier.launch(_batch(["a", "b", "a"]))
    time.sleep(0.1)
    replicas["a"].server.close()
    result = pending.result()
    assert isinstance(result.errors[0], KVLost) and isinstance(result.errors[2], KVLost)
    assert result.errors[1] is None and result.tokens[1] == [2, 3, 1]
    _wait_for(lambda: verifier.channels.get("a") is None and relay.relayed_rows == 2)  # asked again
    replicas["a"].hold.set()
    verifier.launch(_batch(["a"])).result()
    assert relay.relayed_rows == 3  # through the engine's replica, which names a replica gone as such


def test_a_channel_that_does_not_answer_in_time_costs_its_rows_a_recompute(loop):
    replicas = {"a": _Replica("a", loop)}
    verifier = LinkedVerifier(_Relay(replicas, loop), timeout_s=0.3)
    verifier.launch(_batch(["a"])).result()
    _wait_for(lambda: verifier.channels.get("a") is not None)
    replicas["a"].hold.clear()
    start_s = time.monotonic()
    result = verifier.launch(_batch(["a", "a"])).result()
    assert 0.25 < time.monotonic() - start_s < 2.0
    assert all(isinstance(e, KVLost) and e.waited_s > 0 for e in result.errors)
    replicas["a"].hold.set()


def test_a_client_without_the_key_is_refused_and_the_channel_goes_on(loop):
    replica = _Replica("a", loop)
    address = replica.server.address
    with pytest.raises((AuthenticationError, EOFError, ConnectionError)):
        Client((address.host, address.port), authkey=b"not the key")
    verifier = LinkedVerifier(_Relay({"a": replica}, loop), timeout_s=5.0)
    verifier.launch(_batch(["a"])).result()
    _wait_for(lambda: verifier.channels.get("a") is not None)
    assert verifier.launch(_batch(["a", "a"])).result().tokens == _expected(["a", "a"])
    assert replica.server.num_calls == 1


def test_without_channels_every_batch_goes_through_the_replica(loop):
    relay = _Relay({"a": _Replica("a", loop)}, loop)
    verifier = LinkedVerifier(relay, timeout_s=5.0, channels=False)
    for _ in range(3):
        assert verifier.launch(_batch(["a", "a"])).result().tokens == _expected(["a", "a"])
    assert relay.relayed_rows == 6 and verifier.channels is None
