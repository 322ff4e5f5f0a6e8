"""Programmatic dependent launch (PDL) for the layers' Triton kernels (CUDA, compute capability 9 and up).

In a CUDA graph a kernel still starts only once the kernel before it has ended and its writes are
flushed. At batch 1 that costs about a microsecond a kernel: a TinyLlama draft token is 256 kernels,
with ~0.3 ms of its ~1.5 ms free of any (benchmarks/results/kernels_h100/merge/). A kernel launched
with PDL may be scheduled while the one before it drains; `wait_for_prior`, its first statement, holds
each program at `griddepcontrol.wait` until that kernel has completed and its writes are visible. So
only the launch overlaps, never a read. It then lets the next kernel launch at once
(`griddepcontrol.launch_dependents`): without that, the next waits for this one's programs to exit.
cuBLAS's GEMMs between them are launched as before; a kernel after one of them saves its launch only.

On with VPD_PDL=1, off by default until a GPU measurement says it pays (benchmarks/gpu_check.py, VPD_PDL=0
against 1); never under Triton's interpreter or before Hopper.
"""

import functools
import os

import torch
import triton
import triton.language as tl


def enabled(device: torch.device) -> bool:
    """Whether the kernels launched on `device` use PDL."""
    return device.type == "cuda" and _enabled(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _enabled(index: int) -> bool:
    if os.environ.get("TRITON_INTERPRET") == "1" or os.environ.get("VPD_PDL", "0") != "1":
        return False
    from triton.language.extra import cuda

    # gdc_wait came with Triton 3.3, as did the launch_pdl keyword
    return hasattr(cuda, "gdc_wait") and torch.cuda.get_device_capability(index)[0] >= 9


def launch_options(pdl: bool) -> dict:
    """The launch's keyword: none without PDL (Triton before 3.3 does not know it)."""
    return {"launch_pdl": True} if pdl else {}


@triton.jit
def wait_for_prior(PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
