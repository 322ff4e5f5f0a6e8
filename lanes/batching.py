"""Packing ragged token lists into one padded batch."""

import torch

PAD_TOKEN_ID = 0  # any valid id: padded positions write KV past a row's length, which nothing reads


def pad_tokens(rows: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged rows -> (ids [B, Q_max], index of each row's last real token [B])."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), PAD_TOKEN_ID, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
    last = torch.tensor([len(r) - 1 for r in rows], dtype=torch.long)
    return ids.to(device, non_blocking=True), last.to(device, non_blocking=True)
