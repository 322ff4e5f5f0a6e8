"""pdv on a Ray cluster of several nodes (Ray's own `cluster_utils.Cluster` on this host, each node a raylet
with its own object store), each lane pinned by custom resources to a node of its own.

- Each replica runs on the node its `resources` name (node ids read from Ray's actor table).
- Greedy output equals the target's own, and the prompts' KV crossed nodes through the object store:
  the prefill lane counts every byte as copied (none written in place or by peer copy), the verify
  replica took the same bytes, and no decode engine's drafts went by shared memory.
- A node lost under 16 streams (SIGKILL of its raylet and every process under it), once per lane:
  every stream ends within 10 s (completed by recompute, or with an OpenAI-style error), /health names
  the lane that is down, Serve places the replacement on a spare node that offers the lane's resource,
  and the app then serves the same greedy output with no slot or block left held.
- A lane that names a resource no node offers fails at build time, in one line naming both.
"""

import threading
import time

import httpx
import pytest
import torch
from ray._private import ray_constants

from deployments.builder import ConfigError, build_app
from deployments.config import DEFAULT_DRAFT, DEFAULT_TARGET, AppConfig
from lanes.model.loader import load_model
from loadtest.faults import kill_and_recover, kill_node, kill_raylet_tree, lane_processes
from loadtest.workload import WorkloadRequest
from tests.client_errors import assert_clean
from tests.engine_helpers import hf_greedy
from tests.serve_helpers import (HTTP_PORT, MODEL, app_config, delete, deploy, lane_stats, multinode,
                                 wait_until_idle)

pytestmark = pytest.mark.serve(cluster="multinode")

APP = "pdv"
NODE_OF = {"PrefillLane": "prefill_node", "DecodeLane": "decode_node", "VerifyLane": "verify_node"}
STREAMS = 16
# Each stream long enough to be under way at the kill, short enough that all 16 end within 10 s of it on two
# cores (some 330 tokens/s here) when nothing is lost: a stream that ends later waited on the lost node.
STREAM_TOKENS = 128
LATE_STREAMS = 4
# A stream sent during the outage waits for the lane's replacement (some 10-15 s here) or fails once its
# hand-over gives up (PEER_CALL_TIMEOUT_S) or its verify replica is not back within recover_within_s.
LATE_WITHIN_S = 40.0
# Long enough that each prompt's KV (the shipped pair in float32: 16 KiB a token for the target, 3 KiB for
# the draft) is above Ray's 100 KiB limit for objects passed inline in a call: it goes through the object store.
PROMPTS = [f"def handler_{i}(request, response):\n    '''Parse the request, check its headers and body, "
           "and write the response with the status code and the JSON payload that the client expects.'''\n"
           for i in range(4)]
NEW_TOKENS = 24
LANE = {"num_cpus": 0.05, "health_check_period_s": 1.0}


@pytest.fixture(scope="module")
def cluster():
    nodes = multinode(head={"num_cpus": 2, "resources": {"head_node": 1}},
                      workers=[{"num_cpus": 1, "resources": {name: 1}} for name in NODE_OF.values()])
    config = app_config("pdv", DEFAULT_TARGET, DEFAULT_DRAFT, ingress={**LANE, "resources": {"head_node": 1}},
                        **{lane: {**LANE, "resources": {NODE_OF[name]: 1}}
                           for lane, name in (("prefill_lane", "PrefillLane"), ("decode_lane", "DecodeLane"),
                                              ("verify_lane", "VerifyLane"))})
    config["engine"].update(max_model_len=1024, max_num_seqs=STREAMS)  # streams long enough to be cut
    deploy({APP: config})
    yield nodes
    delete([APP])


@pytest.fixture(scope="module")
def node_ids(cluster) -> dict[str, str]:
    """Each custom resource's node, as Ray lists it."""
    return {name: node["NodeID"] for node in _alive_nodes() for name in node["Resources"]
            if name.endswith("_node")}


@pytest.fixture(scope="module")
def target_greedy() -> list[list[int]]:
    """The target's own greedy continuation of each prompt (HF `generate`, in the app's dtype)."""
    target = load_model(DEFAULT_TARGET, dtype=torch.float32)
    return [hf_greedy(target, target.tokenizer.encode(prompt), NEW_TOKENS) for prompt in PROMPTS]


def _alive_nodes() -> list[dict]:
    import ray

    return [node for node in ray.nodes() if node["Alive"]]


def _served_greedy(prompt: str) -> list[int]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    response = httpx.post(f"http://127.0.0.1:{HTTP_PORT}/{APP}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["token_ids"]


def test_each_lane_runs_on_the_node_its_resources_name(node_ids):
    assert len(set(node_ids.values())) == 4, node_ids  # head, prefill, decode and verify: four nodes
    for deployment, resource in NODE_OF.items():
        processes = lane_processes(APP, deployment)
        assert processes and {p.node_id for p in processes} == {node_ids[resource]}, (deployment, processes)
    assert {p.node_id for p in lane_processes(APP, "Ingress")} == {node_ids["head_node"]}


def test_greedy_equals_the_targets_and_the_kv_crossed_nodes_through_the_object_store(target_greedy):
    prefill_before = lane_stats(APP, "PrefillLane")[0]["handed_over_bytes"]
    verify_before = lane_stats(APP, "VerifyLane")[0]["kv_loaded_bytes"]
    assert [_served_greedy(prompt) for prompt in PROMPTS] == target_greedy

    prefill, (verify,) = lane_stats(APP, "PrefillLane")[0], lane_stats(APP, "VerifyLane")
    sent = {model: {how: prefill["handed_over_bytes"][model][how] - prefill_before[model][how] for how in by_how}
            for model, by_how in prefill_before.items()}
    # Both models' KV of every prompt went through the object store: none written in place through a CUDA IPC
    # handle, none by a peer copy. The verify node took every byte of the target's, and each prompt's is
    # above Ray's inline limit (100 KiB); the draft's went to the decode node.
    for model in ("target", "draft"):
        assert sent[model]["in_place"] == sent[model]["peer"] == 0 < sent[model]["copied"], sent
    assert sent["target"]["copied"] == verify["kv_loaded_bytes"] - verify_before > 100 * 1024 * len(PROMPTS), sent
    # The decode engine's drafts reached the verify node over its channel, not by a ring of shared memory.
    assert verify["rings_mapped"] == 0 and verify["ring_calls"] == 0, verify


class HealthWatch:
    """Polls the app's /health every 0.2 s from the kill until it answers 200 again, keeping each 503's lanes."""

    def __init__(self):
        self.down: list[dict[str, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._stop.is_set():
            try:
                response = httpx.get(f"http://127.0.0.1:{HTTP_PORT}/{APP}/health", timeout=10)
                if response.status_code == 503:
                    self.down.append(response.json()["lanes"])
                elif self.down:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)

    def stop(self) -> list[dict[str, str]]:
        self._stop.set()
        self._thread.join(timeout=15)
        return self.down


@pytest.fixture(scope="module")
def spare(cluster):
    """A spare node that offers every lane's resource, for Serve to place each replacement on."""
    cluster.add_node(num_cpus=1, object_store_memory=96 << 20, resources={name: 1 for name in NODE_OF.values()})
    cluster.wait_for_nodes()
    return next(node["NodeID"] for node in _alive_nodes() if len(set(node["Resources"]) & set(NODE_OF.values())) == 3)


@pytest.mark.parametrize("deployment", ["PrefillLane", "VerifyLane", "DecodeLane"])
def test_a_lost_node_ends_every_stream_within_10_s_and_its_lane_comes_back_on_the_spare(deployment, cluster, node_ids,
                                                                                      spare):
    wait_until_idle(APP, "pdv", timeout_s=60)
    streams = [WorkloadRequest(f"def stream_{i}(x):", 5, STREAM_TOKENS) for i in range(STREAMS)]
    late = [WorkloadRequest(f"def late_{i}(y):", 5, STREAM_TOKENS) for i in range(LATE_STREAMS)]  # 1 s after
    watch: list[HealthWatch] = []

    def lose_node(process):
        node = next(n for n in cluster.list_all_nodes() if n.node_id == process.node_id)
        watch.append(HealthWatch())
        if deployment == "DecodeLane":  # as on a cluster of real hosts: by a task placed on the node
            kill_node(process)
        else:  # at once from here: the task would first wait for a worker on the node, and the clock runs
            kill_raylet_tree(node.all_processes[ray_constants.PROCESS_TYPE_RAYLET][0].process.pid)
        cluster.remove_node(node, allow_graceful=False)  # Ray's handle forgets it; nothing of it is left to kill

    result = kill_and_recover(f"http://127.0.0.1:{HTTP_PORT}/{APP}", MODEL, APP, deployment, list(NODE_OF), streams,
                              late, PROMPTS[:2], greedy_max_tokens=NEW_TOKENS, stop=lose_node)
    print(f"{deployment}'s node lost:", result.summary())
    down = watch[0].stop()

    assert result.process.node_id == node_ids[NODE_OF[deployment]]
    for record, end_s in zip(result.in_flight, result.ends_s(result.in_flight)):
        assert record.status in ("completed", "failed"), record  # none timed out
        assert end_s < 10.0, result.summary()
        if record.status == "failed":  # a 503 before the first token, or an SSE error event after it
            assert_clean(record.error)
    # Sent while the lane is down: each waits for the replacement (completed) or gives up (an error); none hangs.
    for record in result.after:
        assert record.status in ("completed", "failed") and record.end_s - record.start_s < LATE_WITHIN_S, record
        if record.status == "failed":
            assert_clean(record.error)
    lane = {"PrefillLane": "prefill", "VerifyLane": "verify", "DecodeLane": "decode"}[deployment]
    assert any(lanes.get(lane, "ok") != "ok" for lanes in down), down  # /health named the lane that was down
    assert result.recovered_s is not None and result.replaced_s is not None, result.notes
    assert {p.node_id for p in lane_processes(APP, deployment)} == {spare}
    assert result.greedy_equal, "greedy output after recovery differs from before the node was lost"
    wait_until_idle(APP, "pdv", timeout_s=60)  # no slot or block held by a lost request on the survivors
    assert all(s["pending"] == 0 for s in lane_stats(APP, "PrefillLane"))


def test_a_resource_no_node_offers_fails_at_build_time_naming_the_lane(cluster):
    config = AppConfig.model_validate(app_config("pdv", DEFAULT_TARGET, DEFAULT_DRAFT,
                                                 verify_lane={**LANE, "resources": {"h100_node": 1}}))
    with pytest.raises(ConfigError) as error:
        build_app(config)
    message = str(error.value)
    assert "verify_lane" in message and "h100_node" in message and "\n" not in message, message
