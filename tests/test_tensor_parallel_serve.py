"""A tensor-parallel target served by Ray Serve on the CPU: each replica that holds the target (the
DecodeLane in unified and nospec; the PrefillLane and DecodeLane in pd; the PrefillLane and
VerifyLane in pdv) owns a placement group of two bundles, its worker rank is a Ray actor in the
second (deployments/replicas/tp_workers.py), and the ranks meet over gloo. Greedy output over HTTP equals HF's
greedy `generate` of the whole target: in pd and pdv every prompt's KV went from the prefill lane's
two ranks to the other lane's two ranks (lanes/parallel/kv_handover.py). A worker rank killed under load fails its
replica's work at once and the replica is replaced: the engine's in nospec, the verify lane's in pdv.
(A replica whose worker never came would not answer /health: rank 0 waits in the group's rendezvous
for every rank before it builds its shards.)"""

import json
import time

import httpx
import pytest
from ray import serve

from lanes.model.loader import load_model
from tests.engine_helpers import hf_greedy, random_prompts
from tests.client_errors import assert_clean
from tests.serve_helpers import HTTP_PORT, MODEL, app_config, greedy_choice, kill_under_streams, openai_client, serving

pytestmark = pytest.mark.serve

MODES = ("unified", "nospec", "pd", "pdv")
STREAMS = 4


@pytest.fixture(scope="module", autouse=True)
def apps(pair_paths):
    target, draft = pair_paths
    configs = {}
    for mode in MODES:
        lane = {"num_cpus": 0.05, "health_check_period_s": 1.0}
        configs[mode] = app_config(mode, target, draft, decode_lane=dict(lane, num_replicas=1),
                                   prefill_lane=lane, verify_lane=lane)
        configs[mode]["target"]["tensor_parallel_size"] = 2
        # In pd and pdv the draft runs whole in the decode lane; the prefill lane (and pd's decode lane,
        # pdv's verify lane) shard the target and hand each prompt's KV over head by head.
        configs[mode]["draft"]["tensor_parallel_size"] = 1 if mode in ("pd", "pdv") else 2
    with serving(configs):
        yield


@pytest.mark.parametrize("mode", MODES)
def test_greedy_output_of_a_tp2_replica_equals_target_greedy(mode, pair_paths):
    target = load_model(pair_paths[0])
    c = openai_client(mode)
    for prompt in random_prompts(4, len(target.tokenizer), 1, 60, seed=31):
        out = c.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0,
                                   extra_body={"ignore_eos": True, "return_token_ids": True})
        assert out.choices[0].token_ids == hf_greedy(target, prompt, 16)


@pytest.mark.parametrize("app, deployment", [("nospec", "DecodeLane"), ("pdv", "VerifyLane")])
def test_a_dead_worker_rank_fails_its_replicas_requests_at_once_and_serve_replaces_the_replica(app, deployment):
    # Runs last in the module: it kills the worker rank of nospec's engine replica, then of pdv's
    # verify replica (SIGKILL), while streams are in flight. Rank 0 would wait on the dead rank in a
    # collective; the replica fails its work instead (deployments/replicas/tp_workers.py: the engine's streams,
    # the verify lane's forwards and so the streams whose rows they held), and its health check, and
    # Serve starts a new replica and workers.
    before = greedy_choice(app, "def add(a, b):")["text"]
    lane = serve.get_deployment_handle(deployment, app_name=app)
    replica_pid = lane.pid.remote().result(timeout_s=30)
    [worker_pid] = lane.shard_pids.remote().result(timeout_s=30)
    killed_s, results = kill_under_streams(app, worker_pid, STREAMS, 200)
    for ended_s, status, events in results:
        if status == 200 and events[-1] == "[DONE]" and '"error"' not in events[-2]:
            continue  # finished before the kill
        assert ended_s - killed_s < 10.0, f"ended {ended_s - killed_s:.1f} s after the kill"
        assert status == 200 and events[-1] == "[DONE]" and '"error"' in events[-2], (status, events[-3:])
        assert_clean(json.loads(events[-2])["error"]["message"])
    deadline = time.monotonic() + 180
    while httpx.get(f"http://127.0.0.1:{HTTP_PORT}/{app}/health", timeout=10).status_code != 200 or \
            lane.pid.remote().result(timeout_s=30) == replica_pid:
        assert time.monotonic() < deadline, "the replica with the dead worker was not replaced"
        time.sleep(1)
    print(f"{app} {deployment} worker rank killed: {STREAMS} streams ended, replica replaced "
          f"{time.monotonic() - killed_s:.1f} s after the kill")
    assert greedy_choice(app, "def add(a, b):")["text"] == before
