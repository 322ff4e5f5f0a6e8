"""Per request: what handing a prompt's KV from the prefill lane to another lane through Ray's object
store costs, on the same node and across two nodes, by the product's own steps (deployments/placement/kv_transfer.py):
`HostKV.from_tensor` on the sender, the object store, `HostKV.tensor` and `KVPool.write_slot` on the
receiver (as deployments/replicas/verify_replica.py `load_kv` does).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/kv_handover.py --out benchmarks/results/kv_handover_cpu

Two Ray nodes on this machine (`ray.cluster_utils.Cluster`: each its own raylet and object store). The
sender runs on node A; a receiver on node A maps the bytes from shared memory (same node), one on node B
pulls them into its own store first, through Ray's object manager over loopback TCP: a real transfer
between two object stores, not a network. A cross-node row's prediction for a real link is the same-node
hand-over (every step but the network) plus bytes / link bandwidth.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import numpy as np
import ray
import torch
from ray.cluster_utils import Cluster
from transformers import AutoConfig

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks is no installed package

from benchmarks.lib.cluster import REPO, git_commit, load_average, log, machine  # noqa: E402
from benchmarks.lib.results import rows_table  # noqa: E402
from deployments.placement.kv_transfer import HostKV  # noqa: E402
from lanes.kv.pool import KVPool, PoolShape  # noqa: E402

STORE_BYTES = 3 * 2**30  # per node: one 2 GiB request (Llama-2-7B, 4,096 tokens) and room to free it
# Both paths' pools at once (their repeats alternate) up to this KV size: the 2 GiB point with two pools
# of it ran this shared 24 GiB machine out of memory (Ray's monitor killed the sender).
POOLS_TOGETHER_BYTES = 2**30
LINKS_GBPS = (25, 200)
LLAMA2_7B = {"num_layers": 32, "num_kv_heads": 32, "head_dim": 128}  # 2*32*32*128*2 B = 512 KiB a token


def kv_models() -> dict[str, tuple[dict, torch.dtype]]:
    """The KV shape and dtype of each model measured: the shipped pair's from their configs, in the
    checkpoints' dtype (the GPU configs' too), and Llama-2-7B's in fp16."""
    models = {}
    for name in ("vpd-target", "vpd-draft"):
        config = AutoConfig.from_pretrained(REPO / "models" / name)
        shape = PoolShape.for_model(config, num_slots=1, capacity_tokens=1)
        dtype = getattr(torch, str(config.dtype).removeprefix("torch."))
        models[name] = ({k: getattr(shape, k) for k in LLAMA2_7B}, dtype)
    models["llama-2-7b-shaped"] = (LLAMA2_7B, torch.float16)
    return models


@ray.remote(num_cpus=0)
class Sender:
    def build(self, dims: dict, dtype: torch.dtype, tokens: int) -> int:
        # [2, layers, kv_heads, tokens, head_dim]: a prompt's KV as the prefill lane hands it over
        self.kv = torch.randn(2, dims["num_layers"], dims["num_kv_heads"], tokens, dims["head_dim"], dtype=dtype)
        return self.kv.nbytes

    def send(self, receiver) -> dict:
        # time.time(), not perf_counter: stamps are compared across processes
        start_s = time.time()
        host = HostKV.from_tensor(self.kv)
        copied_s = time.time()
        # What Ray does with a large actor-call argument, done here so that its cost is timed apart:
        # one copy into this node's object store. Nested in a list, the receiver gets it itself (timed).
        ref = ray.put(host)
        del host
        put_s = time.time()
        times = ray.get(receiver.receive.remote([ref]))
        return {"from_tensor_ms": (copied_s - start_s) * 1e3, "put_ms": (put_s - copied_s) * 1e3,
                "call_ms": (times["called_s"] - put_s) * 1e3, "get_ms": times["get_ms"],
                "write_ms": times["write_ms"], "e2e_ms": (times["written_s"] - start_s) * 1e3}

    def drop(self) -> None:
        self.kv = None


@ray.remote(num_cpus=0)
class Receiver:
    def make_pool(self, dims: dict | None, dtype: torch.dtype | None = None, tokens: int = 0) -> None:
        self.pool = None  # the previous one goes before the next is allocated
        gc.collect()
        if dims is not None:
            self.pool = KVPool(PoolShape(**dims, num_slots=1, capacity_tokens=tokens), dtype, "cpu")

    def receive(self, refs: list) -> dict:
        called_s = time.time()
        kv = ray.get(refs[0])  # same node: mapped from shared memory; across nodes: pulled into this store first
        got_s = time.time()
        slot = self.pool.allocate()  # verify_replica.load_kv's steps
        self.pool.write_slot(slot, kv.tensor(self.pool.kv.device))
        written_s = time.time()
        self.pool.free(slot)
        return {"called_s": called_s, "get_ms": (got_s - called_s) * 1e3,
                "write_ms": (written_s - got_s) * 1e3, "written_s": written_s}


def start_cluster() -> Cluster:
    """Nodes A (head, sender and same-node receiver) and B (cross-node receiver), 1 CPU each."""
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "resources": {"node_a": 2}, "object_store_memory": STORE_BYTES, "include_dashboard": False})
    cluster.add_node(num_cpus=1, resources={"node_b": 1}, object_store_memory=STORE_BYTES)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)  # never a bare init: others run clusters here
    return cluster


def measure(sender, receivers: dict, repeats: int) -> dict[str, dict]:
    """Per path, the medians of each part over `repeats` hand-overs after one warm-up (it touches the
    pool's pages). Paths measured together alternate, in turn first, so that other processes' load on
    this shared machine falls on both alike."""
    for receiver in receivers.values():
        ray.get(sender.send.remote(receiver))
    runs = {path: [] for path in receivers}
    for i in range(repeats):
        for path in list(receivers)[:: 1 if i % 2 == 0 else -1]:
            runs[path].append(ray.get(sender.send.remote(receivers[path])))
    return {path: summary(path_runs) for path, path_runs in runs.items()}


def summary(runs: list[dict]) -> dict:
    parts = {key: round(float(np.median([r[key] for r in runs])), 2) for key in runs[0]}
    parts["e2e_p90_ms"] = round(float(np.percentile([r["e2e_ms"] for r in runs], 90)), 2)
    parts["e2e_ms_runs"] = [round(r["e2e_ms"], 2) for r in runs]  # the spread, for the noise
    return parts


def predicted_ms(same_node_e2e_ms: float, nbytes: int, link_gbps: float) -> float:
    """A hand-over across a real link: the same-node hand-over (serialize, put, call, map, pool write)
    plus the bytes on the wire. A floor: it assumes Ray's pull keeps the link full."""
    return same_node_e2e_ms + nbytes * 8 / (link_gbps * 1e9) * 1e3


def add_derived(row: dict, same_node: dict | None) -> dict:
    gbps = lambda ms: round(row["kv_bytes"] / (ms * 1e6), 3) if ms > 0 else None  # GB/s
    row["e2e_gb_s"] = gbps(row["e2e_ms"])
    if same_node is not None:  # a cross-node row
        row["loopback_pull_gb_s"] = gbps(row["get_ms"])  # pull into node B's store, then map
        for link in LINKS_GBPS:
            row[f"predicted_{link}gbps_ms"] = round(predicted_ms(same_node["e2e_ms"], row["kv_bytes"], link), 2)
    return row


def run(tokens_list: list[int], repeats: int) -> list[dict]:
    sender = Sender.options(resources={"node_a": 1}).remote()
    receivers = {"same_node": Receiver.options(resources={"node_a": 1}).remote(),
                 "cross_node": Receiver.options(resources={"node_b": 1}).remote()}
    rows = []
    for model, (dims, dtype) in kv_models().items():
        for tokens in tokens_list:
            nbytes = ray.get(sender.build.remote(dims, dtype, tokens))
            parts = {}
            for group in [list(receivers)] if 2 * nbytes <= POOLS_TOGETHER_BYTES else [[p] for p in receivers]:
                ray.get([receivers[p].make_pool.remote(dims, dtype, tokens) for p in group])
                parts |= measure(sender, {p: receivers[p] for p in group}, repeats)
                ray.get([receivers[p].make_pool.remote(None) for p in group])  # a shared machine: memory back
            ray.get(sender.drop.remote())
            for path in receivers:
                row = add_derived({"model": model, "tokens": tokens, "path": path, "dtype": str(dtype)[6:],
                                   "kv_bytes": nbytes, "kv_bytes_per_token": nbytes // tokens, **parts[path],
                                   "load_1m": load_average()[0]},
                                  None if path == "same_node" else rows[-1])
                rows.append(row)
                log(f"{model} {tokens} {path}: {row['e2e_ms']} ms, {row['e2e_gb_s']} GB/s")
    return rows


TABLE_COLUMNS = {"model": "model", "tokens": "tokens", "path": "path", "kv_mib": "KV MiB",
                 "serialize_ms": "serialize ms", "get_ms": "get ms", "write_ms": "pool write ms",
                 "e2e_ms": "e2e ms p50", "e2e_p90_ms": "e2e ms p90", "e2e_gb_s": "GB/s",
                 "predicted_25gbps_ms": "25 Gb/s ms", "predicted_200gbps_ms": "200 Gb/s ms"}


def table(rows: list[dict]) -> str:
    shown = [{**r, "kv_mib": round(r["kv_bytes"] / 2**20, 2), "serialize_ms": round(r["from_tensor_ms"] + r["put_ms"], 2)}
             for r in rows]
    return rows_table([{label: r.get(key) for key, label in TABLE_COLUMNS.items()} for r in shown], labels=3)


def readme(document: dict) -> str:
    m = document["machine"]
    largest = max((r for r in document["rows"] if r["path"] == "cross_node"), key=lambda r: r["kv_bytes"])
    return f"""# KV hand-over across nodes vs the same node (CPU, loopback)

    {document["command"]}

Machine: {m["cpu_model"]}, {m["cpu_cores"]} cores, {m["memory_gib"]} GiB, no GPU; Ray {m["ray"]}, torch {m["torch"]};
commit {document["commit"]}; load average {document["load_average_before"]} before, {document["load_average_after"]} after
(other engineers' tests shared the 2 cores: single runs are noisy, hence medians over {document["repeats"]} repeats).

Per request: the sender (node A) copies the KV out with `HostKV.from_tensor` and puts it into its object
store (serialize = both); the receiver gets it (same node: mapped from shared memory; cross node: pulled
into node B's store by Ray's object manager over loopback TCP, a real store-to-store transfer but no
network: {largest["loopback_pull_gb_s"]} GB/s for the largest KV, small ones are latency-bound) and writes it
into a `KVPool` (`write_slot`, as `load_kv`). e2e: the sender's start to the pool write done. Same- and
cross-node repeats alternate, except for KV over {POOLS_TOGETHER_BYTES // 2**21} MiB (two pools of it do not fit this
shared machine): same-node ones first. Predicted at 25 and 200 Gb/s: the same-node e2e (every step but the
network) + bytes / link bandwidth, a floor that assumes Ray's pull keeps the link full. The shipped pair in
its checkpoints' bfloat16 (the CPU configs run float32: twice the bytes); its context is 2,048 tokens, so
its 4,096-token rows are a KV size, not a prompt it serves. `load_1m` in results.json: the machine's load
average when each row ended.

{table(document["rows"])}"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks/results/kv_handover_cpu")
    parser.add_argument("--tokens", default="128,1024,4096", help="prompt lengths, comma-separated")
    parser.add_argument("--repeats", type=int, default=7, help="timed hand-overs per row, after one warm-up")
    args = parser.parse_args()
    before = load_average()
    cluster = start_cluster()
    try:
        rows = run([int(t) for t in args.tokens.split(",")], args.repeats)
    finally:
        ray.shutdown()
        cluster.shutdown()
    command = "OMP_NUM_THREADS=1 .venv/bin/python benchmarks/kv_handover.py " + " ".join(sys.argv[1:])
    document = {"command": command, "machine": machine(), "commit": git_commit(), "repeats": args.repeats,
                "load_average_before": before, "load_average_after": load_average(), "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(document, indent=1))
    (args.out / "README.md").write_text(readme(document))
    print(table(rows))


if __name__ == "__main__":
    main()
