"""CUDA streams by lane priority, for lanes that share one GPU.

Decode (draft) work is the most latency-critical, verify next, prefill last. Kernels queued on a
higher-priority stream are scheduled ahead of pending kernels of lower-priority streams, so a long
prefill chunk running beside a decode step does not delay it. A lower number is a higher priority;
values outside the device's range are clamped to it. On the CPU every stream is None (no-op).
"""

import contextlib

import torch

DECODE_PRIORITY = -2
VERIFY_PRIORITY = -1
PREFILL_PRIORITY = 0


def lane_stream(device: torch.device, priority: int) -> torch.cuda.Stream | None:
    return torch.cuda.Stream(device, priority=priority) if device.type == "cuda" else None


def on(stream: torch.cuda.Stream | None):
    """Run the enclosed work on `stream` (the current stream when None)."""
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


class LaneStreams:
    def __init__(self, device: torch.device, separate: bool = True):
        """`separate=False`: every lane on the current stream. A tensor-parallel engine runs so: its
        forwards all-reduce over one NCCL communicator, whose collectives must not run concurrently
        from different streams (NCCL orders them by launch, and two in flight at once can deadlock)."""
        self.device = device
        self.decode, self.verify, self.prefill = (
            (lane_stream(device, p) for p in (DECODE_PRIORITY, VERIFY_PRIORITY, PREFILL_PRIORITY)) if separate
            else (None, None, None))

    def decode_after_current(self) -> None:
        """Prompt KV copied in from another process lands on the current stream (the engine writes it
        into the pools between steps): order the next draft and verify work after those writes."""
        if self.decode is not None:
            self.decode.wait_stream(torch.cuda.current_stream(self.decode.device))

    def verify_after_decode(self) -> None:
        """Verification reads the drafts: order it after the decode stream's work."""
        if self.verify is not None:
            self.verify.wait_stream(self.decode)
