"""The host form of a copied KV: exact round trip, and bytes that pickle out-of-band (no in-band
copy through torch's own serialisation, which made cross-GPU hand-overs slow)."""

import pickle

import pytest
import torch

from deployments.placement.kv_transfer import HostKV


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_host_kv_round_trips_exactly(dtype):
    kv = torch.randn(2, 3, 4, 7, 16).to(dtype)
    host = HostKV.from_tensor(kv[:, :, :, :5])  # a strided view, as a slot's valid prefix is
    assert host.num_tokens == 5 and host.nbytes == kv[:, :, :, :5].numel() * kv.element_size()
    assert torch.equal(host.tensor("cpu"), kv[:, :, :, :5])


def test_host_kv_pickles_its_bytes_out_of_band():
    kv = torch.randn(2, 2, 2, 64, 16).to(torch.bfloat16)
    buffers = []
    payload = pickle.dumps(HostKV.from_tensor(kv), protocol=5, buffer_callback=buffers.append)
    assert len(payload) < 4096 and sum(memoryview(b).nbytes for b in buffers) == kv.numel() * 2
    back = pickle.loads(payload, buffers=buffers)
    assert torch.equal(back.tensor("cpu"), kv)
