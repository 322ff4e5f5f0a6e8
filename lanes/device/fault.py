"""Whether a failed forward left its device unusable.

Most CUDA errors are sticky: after an illegal memory access or a device-side assert, every later
call on that context fails, so a replica that goes on serving fails every request until it is
replaced. Only the process that met the error can see it (the context is per process), so each one
that runs GPU work probes its device after a failure and reports what it found to the replica's
health check, which makes Serve replace the replica.
"""

import torch


def device_fault(device: torch.device) -> str | None:
    """None while `device` still runs work; else the error that a tiny kernel and a sync now raise.

    Called after a failure only (it waits for every queued kernel on the device)."""
    if device.type != "cuda":
        return None  # no sticky state on the CPU: a failed forward fails only its own batch
    try:
        torch.ones(1, device=device).add_(1).cpu()
        torch.cuda.synchronize(device)
    except torch.OutOfMemoryError:
        return None  # memory is short, not the context broken: the next step may fit (lanes/engine/step_cap.py)
    except Exception as exc:  # noqa: BLE001 - whatever the context raises now is the finding
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return None
