"""Moving host lists to the device and results back without stalling it, and packing ragged token lists."""

from dataclasses import dataclass

import torch

PAD_TOKEN_ID = 0  # any valid id: padded positions write KV past a row's length, which nothing reads


def to_device(values, dtype: torch.dtype, device) -> torch.Tensor:
    """A host list (or list of equal-length lists, or array) as a device tensor; always a copy.

    Each call is one copy with a fixed host cost (~20 us on CUDA), so hot paths pass all their
    per-row columns at once and unpack the rows of the result. On CUDA the copy goes from pinned
    memory, so it is truly asynchronous: a copy from pageable memory would make the host wait for
    the GPU first."""
    host = torch.tensor(values, dtype=dtype)
    if torch.device(device).type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


@dataclass
class HostCopy:
    """A device-to-host copy in flight: `wait()` returns the host tensor once it has landed."""

    tensor: torch.Tensor  # pinned host memory on CUDA (filled asynchronously), the result itself on the CPU
    done: torch.cuda.Event | None

    @property
    def ready(self) -> bool:
        return self.done is None or self.done.query()

    def wait(self) -> torch.Tensor:
        if self.done is not None:
            self.done.synchronize()
        return self.tensor


def to_host_async(values: torch.Tensor) -> HostCopy:
    """Queue the copy of `values` to the host on the current stream; nothing waits for it here."""
    if values.device.type != "cuda":
        return HostCopy(values.cpu(), None)
    host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
    host.copy_(values, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    return HostCopy(host, done)


def pad_rows(rows: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    """Ragged rows -> (rows padded to the longest, index of each row's last real token), on the host."""
    width = max(len(r) for r in rows)
    return [row + [PAD_TOKEN_ID] * (width - len(row)) for row in rows], [len(r) - 1 for r in rows]


def pad_tokens(rows: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged rows -> (ids [B, Q_max], index of each row's last real token [B]) on the device."""
    padded, last = pad_rows(rows)
    return to_device(padded, torch.long, device), to_device(last, torch.long, device)
