"""benchmarks/kv_handover.py: the KV bytes a token of each measured model hands over, and a real link's
predicted hand-over (no Ray started)."""

import pytest
import torch

from benchmarks.kv_handover import add_derived, kv_models, predicted_ms


def test_kv_bytes_per_token_come_from_the_configs():
    def per_token_bytes(dims: dict, dtype: torch.dtype) -> int:
        return 2 * dims["num_layers"] * dims["num_kv_heads"] * dims["head_dim"] * dtype.itemsize

    bytes_by_model = {name: per_token_bytes(*model) for name, model in kv_models().items()}
    # vpd-target: 8 layers x 8 heads x 32; vpd-draft: 2 x 6 x 32; both bfloat16. Llama-2-7B: 32 x 32 x 128 fp16.
    assert bytes_by_model == {"vpd-target": 8192, "vpd-draft": 1536, "llama-2-7b-shaped": 512 * 1024}


def test_a_link_adds_bytes_over_its_bandwidth_to_the_same_node_handover():
    nbytes = 512 * 2**20  # Llama-2-7B's KV of 1,024 tokens
    assert predicted_ms(100.0, nbytes, 25) == pytest.approx(100.0 + nbytes * 8 / 25e9 * 1e3)  # +171.8 ms
    assert predicted_ms(100.0, nbytes, 200) == pytest.approx(100.0 + 21.47, abs=0.01)


def test_only_cross_node_rows_get_predictions():
    same = add_derived({"kv_bytes": 10**9, "e2e_ms": 500.0, "get_ms": 1.0}, None)
    cross = add_derived({"kv_bytes": 10**9, "e2e_ms": 1500.0, "get_ms": 1000.0}, same)
    assert "predicted_25gbps_ms" not in same and same["e2e_gb_s"] == 2.0
    assert cross["loopback_pull_gb_s"] == 1.0
    assert cross["predicted_25gbps_ms"] == pytest.approx(500.0 + 320.0)
    assert cross["predicted_200gbps_ms"] == pytest.approx(500.0 + 40.0)
