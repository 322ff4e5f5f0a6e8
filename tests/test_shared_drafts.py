"""The ring that hands a batch's drafts to a verify process on the same device (lanes/device/shared_drafts.py):
on the CPU, shared memory mapped a second time as a verify replica maps it. The CUDA ring (IPC memory and
interprocess events) runs on a GPU: benchmarks/lanes_1gpu.py serves pdv through it."""

import pickle

import pytest
import torch

from lanes.device.shared_drafts import RING_SLOTS, DraftRef, DraftRing, OpenRing, can_open


def test_each_batch_lands_in_the_next_slot_and_reads_back_where_the_ring_is_mapped_again():
    ring = DraftRing(torch.device("cpu"), max_rows=6, width=4)
    try:
        handle = pickle.loads(pickle.dumps(ring.handle()))  # it travels as a channel message does
        assert can_open(handle, torch.device("cpu"))
        mapped = OpenRing(handle)
        batches = [torch.randint(0, 1000, (1 + k % 6, 1 + k % 4)) for k in range(RING_SLOTS + 2)]
        refs = []
        for k, drafts in enumerate(batches):
            ref = pickle.loads(pickle.dumps(ring.put(drafts)))
            assert ref == DraftRef(ring.ring_id, k % RING_SLOTS, *drafts.shape)
            refs.append(ref)
            taken = mapped.take(ref)
            assert torch.equal(taken, drafts)
        # A taken batch is a copy: the slot's next batch does not change it.
        first = mapped.take(refs[-1])
        for _ in range(RING_SLOTS):  # every slot written again, that one included
            ring.put(torch.zeros_like(batches[-1]))
        assert torch.equal(first, batches[-1])
        mapped.close()
    finally:
        ring.close()


def test_a_batch_that_does_not_fit_the_ring_is_not_put_there():
    ring = DraftRing(torch.device("cpu"), max_rows=4, width=3)
    try:
        assert ring.fits(torch.zeros(4, 3, dtype=torch.long))
        assert not ring.fits(torch.zeros(5, 3, dtype=torch.long))  # more rows than the ring
        assert not ring.fits(torch.zeros(4, 4, dtype=torch.long))  # more drafts than its width
        assert not ring.fits(torch.zeros(4, 3, dtype=torch.int32))
    finally:
        ring.close()


def test_a_ring_is_mapped_only_on_its_own_device_and_goes_when_its_engine_closes_it():
    ring = DraftRing(torch.device("cpu"), max_rows=2, width=2)
    handle = ring.handle()
    elsewhere = type(handle)(handle.ring_id, "cuda:GPU-0000", handle.shape, handle.memory, handle.events)
    assert not can_open(elsewhere, torch.device("cpu"))
    mapped = OpenRing(handle)
    ref = ring.put(torch.tensor([[1, 2]]))
    ring.close()  # the engine's channel ended: the name goes, a mapping keeps what it holds
    assert mapped.take(ref).tolist() == [[1, 2]]
    with pytest.raises(FileNotFoundError):
        OpenRing(handle)
    mapped.close()
