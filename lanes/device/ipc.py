"""Device memory shared between processes on one host: which GPU a handle names, and how to map it here.

Processes that see several GPUs may number them differently (CUDA_VISIBLE_DEVICES), so a handle names
its GPU by UUID, and the process that opens it maps that to its own index.
"""

import torch

_IPC_DEVICE_ARG = 6  # storage_device in torch.multiprocessing.reductions.rebuild_cuda_tensor's arguments


def gpu_uuid(device: int | torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


def local_index(uuid: str) -> int:
    """This process's index of the GPU with this UUID."""
    for index in range(torch.cuda.device_count()):
        if gpu_uuid(index) == uuid:
            return index
    raise RuntimeError(f"GPU {uuid} is not visible to this process")


def open_cuda_tensor(ipc: tuple, uuid: str) -> torch.Tensor:
    """The tensor that `torch.multiprocessing.reductions.reduce_tensor` exported as `ipc` from another
    process, mapped here on this process's index of GPU `uuid` (the exporter's index may differ)."""
    rebuild, args = ipc
    args = list(args)
    args[_IPC_DEVICE_ARG] = local_index(uuid)
    return rebuild(*args)
