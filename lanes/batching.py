"""Moving host lists to the device without stalling it, and packing ragged token lists."""

import torch

PAD_TOKEN_ID = 0  # any valid id: padded positions write KV past a row's length, which nothing reads


def to_device(values, dtype: torch.dtype, device) -> torch.Tensor:
    """A host list as a device tensor. On CUDA the copy goes from pinned memory, so it is truly
    asynchronous: a copy from pageable memory would make the host wait for the GPU first."""
    host = torch.tensor(values, dtype=dtype)
    if torch.device(device).type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def pad_tokens(rows: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged rows -> (ids [B, Q_max], index of each row's last real token [B])."""
    width = max(len(r) for r in rows)
    padded = [row + [PAD_TOKEN_ID] * (width - len(row)) for row in rows]
    return to_device(padded, torch.long, device), to_device([len(r) - 1 for r in rows], torch.long, device)
