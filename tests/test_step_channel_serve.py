"""`stream_channel: step` served (deployments/channels/step_channel.py, step_inbox.py): in spec, two
ingress replicas read two decode replicas, each through one subscription per replica; in pdv, one ingress
replica. Every stream is the target's greedy output in full, a step's outputs of many requests go as one
message, a client that leaves frees its request in the lanes, and a decode replica killed under streams
ends each of its streams with an error, none hung."""

import asyncio
import json

import httpx
import pytest

from lanes.model.loader import load_model
from tests.client_errors import assert_clean
from tests.engine_helpers import hf_greedy, random_prompts
from tests.serve_helpers import (MODEL, app_config, base_url, kill_under_streams, lane_stats, openai_client,
                                 serving, stream_greedy, wait_until_idle)

pytestmark = pytest.mark.serve

APP = "spec_step"
PDV = "pdv_step"
TOKENS = 24


@pytest.fixture(scope="module", autouse=True)
def apps(pair_paths):
    target, draft = pair_paths
    lane = {"num_cpus": 0.05, "health_check_period_s": 1.0}
    # Every step streamed, as the step channel is meant and was measured: with a message bound each request's
    # chunks wait for a timer of their own, so one step's chunks can reach the channel at several moments and
    # go as several messages.
    channel = {"stream_channel": "step", "max_stream_messages_per_s": None}
    config = app_config("spec", target, draft, **channel, ingress={**lane, "num_replicas": 2},
                        decode_lane={**lane, "num_replicas": 2})
    config["engine"].update(max_model_len=1024, max_num_seqs=16)  # streams long enough to be cut
    # pdv, as app_config deploys it (two decode replicas, one verify and one prefill replica, one ingress)
    with serving({APP: config, PDV: app_config("pdv", target, draft, **channel)}):
        yield


@pytest.fixture(scope="module")
def greedy_refs(pair_paths):
    target = load_model(pair_paths[0])
    prompts = random_prompts(12, len(target.tokenizer), 1, 60, seed=5)
    return [(p, hf_greedy(target, p, TOKENS)) for p in prompts]


@pytest.mark.parametrize("app, ingress_replicas", [(APP, 2), (PDV, 1)])
def test_concurrent_streams_are_the_targets_greedy_output_with_one_message_per_step(app, ingress_replicas,
                                                                                    greedy_refs):
    stats = lane_stats(app, "DecodeLane")
    before = [sum(s[key] for s in stats) for key in ("channel_messages", "num_steps")]

    async def run():
        async with httpx.AsyncClient(timeout=300) as http:
            return await asyncio.gather(*(stream_greedy(http, app, p, TOKENS, asyncio.Event())
                                          for p, _ in greedy_refs))

    streams = asyncio.run(run())
    for (_, ref), got in zip(greedy_refs, streams):
        assert got.error is None and got.tokens == ref
    stats = lane_stats(app, "DecodeLane")
    messages, steps = (sum(s[key] for s in stats) - b for key, b in zip(("channel_messages", "num_steps"), before))
    chunks = sum(len(s.times_s) for s in streams)
    print(f"{len(streams)} streams: {chunks} chunks reached the clients through {messages} channel messages "
          f"in {steps} engine steps")
    # Each request's first chunk came on its own call, every other through a channel message: at most one a
    # step for each ingress replica, where one a request would be up to 12 a step.
    assert 0 < messages <= ingress_replicas * steps, (messages, steps)
    assert messages < chunks - len(streams), (messages, chunks)  # some message carried several requests
    wait_until_idle(app, "spec" if app == APP else "pdv")


def test_non_streamed_answers_and_choices_come_through_the_channel_too(greedy_refs):
    prompt, ref = greedy_refs[0]
    c = openai_client(APP)
    out = c.completions.create(model=MODEL, prompt=prompt, max_tokens=TOKENS, temperature=0, n=2,
                               extra_body={"ignore_eos": True, "return_token_ids": True})
    assert [ch.token_ids for ch in out.choices] == [ref, ref]
    one = c.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0,
                               extra_body={"ignore_eos": True, "return_token_ids": True})
    assert one.choices[0].token_ids == ref[:1]  # its first output is its last: nothing went to a channel


def test_a_client_that_leaves_frees_its_request_in_the_lanes():
    body = {"model": MODEL, "prompt": "def f(x):", "max_tokens": 900, "temperature": 0, "ignore_eos": True,
            "stream": True}
    for _ in range(3):
        with httpx.stream("POST", f"{base_url(APP)}/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            assert sum(1 for line, _ in zip(lines, range(6)) if line.startswith("data: ")) >= 3
    wait_until_idle(APP, "spec", timeout_s=30)  # every left request aborted, its KV freed


def test_a_decode_replica_killed_under_streams_fails_its_streams_and_none_hangs():
    pid = lane_stats(APP, "DecodeLane")[0]["replica_pid"]
    _, results = kill_under_streams(APP, pid, 12, 600)
    completed = failed = 0
    for _, status, events in results:
        if status == 200 and events[-1] == "[DONE]" and '"error"' not in events[-2]:
            completed += 1
            continue
        failed += 1
        assert status in (200, 503), status
        if status == 200:  # cut mid-stream: an error event, then [DONE]
            assert events[-1] == "[DONE]" and '"error"' in events[-2], events[-3:]
            assert_clean(json.loads(events[-2])["error"]["message"])
    assert failed >= 1 and completed >= 1, (completed, failed)  # the other replica's streams finished
