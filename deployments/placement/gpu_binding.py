"""Which GPUs a lane replica sees: its own, and with `kv_peer_access` its node's others too.

By default Ray shows a replica only its own GPU (it sets CUDA_VISIBLE_DEVICES), so a peer replica's
GPU does not exist for it and KV can cross GPUs only through host memory. With the app's
`kv_peer_access`, Ray leaves CUDA_VISIBLE_DEVICES alone (RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES)
and the replica lists every GPU of its node itself, its own first: `cuda` (index 0) stays its own
GPU in every thread, as Ray would have made it, and the others are visible, so the prefill lane can
open a peer's KV pool through CUDA IPC and write a prompt's KV into it by a peer copy over NVLink or
PCIe. Indices then differ between processes; pools are matched by GPU UUID (deployments/placement/kv_transfer.py).
"""

import logging
import os

logger = logging.getLogger(__name__)

NOSET_ENV = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"
# NVIDIA MPS: a client process's kernel priority against the other clients on its GPU (0 normal, 1 below
# normal). Lanes on one GPU under MPS run their kernels side by side; this is what keeps prefill behind
# decode and verify there, as unified's stream priorities do inside its one process. Ignored without MPS.
MPS_PRIORITY_ENV = "CUDA_MPS_CLIENT_PRIORITY"
# NVIDIA MPS: the share of the GPU's SMs a client's kernels may occupy (percent). A priority only orders
# kernels waiting to start; a prefill forward already running holds its SMs until its blocks end. A cap
# leaves the rest of the SMs free for decode's kernels at every moment (Semi-PD partitions SMs so).
MPS_SM_PERCENT_ENV = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"


def peer_access_env(num_gpus: float, enabled: bool) -> dict[str, str]:
    """Environment variables of a lane replica: Ray keeps out of CUDA_VISIBLE_DEVICES, where that applies."""
    return {NOSET_ENV: "1"} if enabled and num_gpus > 0 else {}


def mps_priority_env(priority: str, num_gpus: float) -> dict[str, str]:
    """Environment variables of a lane replica for its MPS priority: set only where it lowers one on a GPU."""
    return {MPS_PRIORITY_ENV: "1"} if priority == "below_normal" and num_gpus > 0 else {}


def mps_sm_percent_env(sm_percent: int | None, num_gpus: float) -> dict[str, str]:
    """Environment variables of a lane replica for its MPS share of SMs: set only where it caps one on a GPU."""
    capped = sm_percent is not None and sm_percent < 100 and num_gpus > 0
    return {MPS_SM_PERCENT_ENV: str(sm_percent)} if capped else {}


def log_mps_sm_share() -> None:
    """Inside a lane replica capped by `mps_sm_percent`, after it chose its GPU: log the cap beside the SM
    count CUDA reports to it, for the operator who checks what the replica ran with."""
    if percent := os.environ.get(MPS_SM_PERCENT_ENV):
        import torch

        logger.info("MPS: this lane's kernels may occupy %s %% of the SMs; CUDA reports %d SMs", percent,
                    torch.cuda.get_device_properties(0).multi_processor_count)


def own_gpu_first(own_id: str, node_gpus: list[str]) -> str:
    """CUDA_VISIBLE_DEVICES listing every GPU of the node, the replica's own (as Ray names it) first.

    Ray names GPUs by the node's CUDA_VISIBLE_DEVICES entries where the node was started with one,
    else by physical index; `node_gpus` is that list.
    """
    if own_id not in node_gpus:
        raise ValueError(f"Ray assigned GPU {own_id!r}, not among the node's GPUs {node_gpus}")
    return ",".join([own_id] + [gpu for gpu in node_gpus if gpu != own_id])


def lane_device(num_gpus: float) -> str:
    """The device a replica's models and pools use. Call before anything initialises CUDA."""
    if num_gpus <= 0:
        return "cpu"
    if not os.environ.get(NOSET_ENV):
        return "cuda"  # Ray shows this replica only its own GPU

    import ray
    import torch

    ids = ray.get_gpu_ids() if ray.is_initialized() else []
    if not ids:
        return "cuda"  # not in a Ray replica (a test, a script): whatever CUDA_VISIBLE_DEVICES says
    if torch.cuda.is_initialized():
        raise RuntimeError("CUDA was initialised before the replica chose its GPUs: CUDA_VISIBLE_DEVICES "
                           "can no longer take effect (set kv_peer_access: false to let Ray set it)")
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    node_gpus = [gpu.strip() for gpu in listed.split(",")] if listed else [str(i) for i in range(_node_gpu_count(ray))]
    os.environ["CUDA_VISIBLE_DEVICES"] = own_gpu_first(str(ids[0]), node_gpus)
    return "cuda"


def _node_gpu_count(ray) -> int:
    # From Ray, not CUDA: asking CUDA would initialise it before CUDA_VISIBLE_DEVICES is set.
    node_id = ray.get_runtime_context().get_node_id()
    node = next(n for n in ray.nodes() if n["NodeID"] == node_id)
    return int(node["Resources"].get("GPU", 0))
