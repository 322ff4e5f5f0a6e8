"""cluster.yaml started on this machine: Ray's fake multi-node provider (the one Ray's own autoscaler tests
run, `ray.cluster_utils.AutoscalingCluster`) in place of the cloud's. The head is `ray start --head
--autoscaling-config=...`, so Ray's autoscaler runs beside it, reads the file's node types, and starts or
terminates worker nodes, each a raylet of this machine offering the logical resources its type names.

Started as AutoscalingCluster.start starts it, but on a GCS port and a temp dir of its own, and stopped by
ending only the processes under that temp dir: AutoscalingCluster runs `ray stop`, which would end every Ray
cluster of the machine (other test sessions', other engineers')."""

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import ray
import yaml
from ray.autoscaler._private.util import prepare_config

CLUSTER_YAML = Path(__file__).resolve().parent.parent / "cluster.yaml"
# What the test variant sets beside the provider: nodes idle for 6 s go (the file's 10 min would outlast a test).
IDLE_TIMEOUT_MINUTES = 0.1
FAKE_OVERRIDES = {"idle_timeout_minutes": IDLE_TIMEOUT_MINUTES}
OBJECT_STORE_BYTES = 100 * 2**20  # per node: the tiny pair's KV hand-overs are kilobytes
STOP_GRACE_S = 5.0


def launcher_config(path: Path = CLUSTER_YAML) -> dict:
    """The file as `ray up` hands it to the autoscaler: Ray's defaults for its provider filled in."""
    return prepare_config(yaml.safe_load(path.read_text()))


def fake_variant(config: dict, gcs_address: str) -> dict:
    """The same cluster on Ray's fake multi-node provider: only the provider block (and FAKE_OVERRIDES) differ.
    `gcs_address`: the head's, where the provider's nodes connect (it assumes port 6379 otherwise)."""
    provider = {"type": "fake_multinode", "gcs_address": gcs_address,
                # No SSH and no cloud: the provider starts raylets itself, with no updater to run commands.
                "use_node_id_as_ip": True, "disable_node_updaters": True, "disable_launch_config_check": True,
                "launch_multiple": True}  # n nodes asked for at once are started at once (else one per update)
    return {**config, "provider": provider, **FAKE_OVERRIDES}


def node_layout(config: dict) -> dict:
    """What a cluster config says about its nodes: per type its resources, min and max workers, and which is
    the head."""
    head = config["head_node_type"]
    return {name: {"resources": spec.get("resources", {}), "min_workers": spec.get("min_workers", 0),
                   "max_workers": spec.get("max_workers"), "head": name == head}
            for name, spec in config["available_node_types"].items()}


def _free_port() -> int:
    """A port free on every interface (the GCS listens on the node's address, not only on loopback)."""
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


class FakeCluster:
    """cluster.yaml's fake variant, started and stopped; `address` is its GCS, for `ray.init(address=...)`.
    `env_vars`: settings of every Ray process on every node (RAY_* settings read by raylets and workers)."""

    def __init__(self, config: dict, env_vars: dict[str, str] | None = None):
        self.env_vars = env_vars or {}
        self.temp_dir = tempfile.mkdtemp(prefix="vpd-fake-")  # short: Ray's socket paths live under it
        self.address = f"{ray.util.get_node_ip_address()}:{_free_port()}"
        self.config = fake_variant(config, self.address)
        self.head_resources = self.config["available_node_types"][self.config["head_node_type"]]["resources"]

    def start(self) -> None:
        config_path = Path(self.temp_dir) / "autoscaling.yaml"
        config_path.write_text(json.dumps(self.config))
        # The autoscaler hashes file_mounts' local paths ("."): from an empty directory, not the repository.
        workdir = Path(self.temp_dir) / "launcher"
        workdir.mkdir()
        env = {**os.environ,
               # As AutoscalingCluster.start: the fake provider refuses to run without it; updates every second.
               "RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1",
               # Every node (the autoscaler starts the workers' raylets) and every worker on them: small object
               # stores, one thread each, and no workers prestarted for the head's logical CPUs (2 real cores).
               "RAY_DEFAULT_OBJECT_STORE_MAX_MEMORY_BYTES": str(OBJECT_STORE_BYTES), "OMP_NUM_THREADS": "1",
               "RAY_prestart_worker_first_driver": "0",
               # `ray start` turns token authentication on where ~/.ray/auth_token exists (another local cluster
               # made it), and a driver that joins by address only where RAY_AUTH_MODE says so: off, for both.
               "RAY_AUTH_MODE": "disabled", **self.env_vars}
        port = self.address.rsplit(":", 1)[1]
        ray_cli = Path(sys.executable).with_name("ray")
        subprocess.run([str(ray_cli), "start", "--head", f"--port={port}", f"--temp-dir={self.temp_dir}",
                        f"--autoscaling-config={config_path}", *self._head_resource_args(),
                        "--include-dashboard=false", "--disable-usage-stats",
                        f"--ray-client-server-port={_free_port()}", f"--dashboard-agent-listen-port={_free_port()}"],
                       env=env, cwd=workdir, check=True, capture_output=True, timeout=180)

    def _head_resource_args(self) -> list[str]:
        """The head type's resources as `ray start` flags (as AutoscalingCluster.start passes them; the launcher
        sets them in RAY_OVERRIDE_RESOURCES, which the autoscaler, started by this head, would pass on to every
        node it starts)."""
        custom = dict(self.head_resources)
        cpus, gpus = custom.pop("CPU", None), custom.pop("GPU", None)
        return [*([f"--num-cpus={cpus:g}"] if cpus is not None else []),
                *([f"--num-gpus={gpus:g}"] if gpus is not None else []),
                *([f"--resources={json.dumps(custom)}"] if custom else [])]

    def processes(self) -> list[psutil.Process]:
        """Every process of this cluster: those whose command line names its temp dir (GCS, raylets, the
        autoscaler, agents, workers, on every node), and their children (an engine process a replica started)."""
        found = {}
        for proc in psutil.process_iter(["cmdline"]):
            if any(self.temp_dir in arg for arg in proc.info["cmdline"] or ()):
                found[proc.pid] = proc
        for proc in list(found.values()):
            try:
                found.update((child.pid, child) for child in proc.children(recursive=True))
            except psutil.NoSuchProcess:
                pass
        found.pop(os.getpid(), None)  # the driver, should its command line name the dir
        return list(found.values())

    def shutdown(self) -> None:
        """End this cluster's processes (SIGTERM, then SIGKILL after a grace period), none other; then its
        temp dir, unless a process outlived that."""
        procs = self.processes()
        _signal(procs, "terminate")
        psutil.wait_procs(procs, timeout=STOP_GRACE_S)
        deadline = time.monotonic() + STOP_GRACE_S
        # Those left, and any started meanwhile (a worker a raylet was starting).
        while (left := self.processes()) and time.monotonic() < deadline:
            _signal(left, "kill")
            psutil.wait_procs(left, timeout=1)
        if not left:
            shutil.rmtree(self.temp_dir, ignore_errors=True)


def _signal(procs: list[psutil.Process], how: str) -> None:
    for proc in procs:
        try:
            getattr(proc, how)()
        except psutil.NoSuchProcess:
            pass
