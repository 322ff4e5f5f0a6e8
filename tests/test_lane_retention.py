"""pdv's three lane replicas keep nothing per request once their requests have ended: every container
they key by request (or by a request's slot) is empty again. In one process (tests/pdv_in_process.py),
so that what the replicas' own code holds is all there is to see; lane_retention (docs/diagnoses.md) measured the
bytes a request leaves behind the same way."""

import asyncio

import deployments.replicas.prefill_replica as prefill_replica
from tests.pdv_in_process import build_pdv, drive, per_request_state


def test_pdv_replicas_hold_no_per_request_state_after_their_requests_end(pair_paths, monkeypatch):
    monkeypatch.setattr(prefill_replica, "PEER_CALL_TIMEOUT_S", 120.0)  # a busy 2-core host stalls, loses nothing

    async def serve_and_look() -> tuple[int, dict[str, int]]:
        # Built inside the event loop, as Serve builds a replica: the engine keeps the loop it started on.
        decode, prefill, verify = build_pdv(*pair_paths)
        decode.engine.core.verifier.timeout_s = 120.0
        vocab = decode.engine.core.vocab_size
        # Mixed lengths: the 40-token prompts take two prefill chunks (prefill_chunk_tokens 32).
        prompts = [[3 + (7 * i + j) % (vocab - 3) for j in range(40 if i % 4 == 0 else 12)] for i in range(16)]
        try:
            made = await asyncio.wait_for(drive(decode, prompts, 0, 16, 4, 8), timeout=300)
            # A stream ends before its slots are freed: the decode lane tells the verify lane after the
            # last token, without waiting for the answer.
            deadline = asyncio.get_running_loop().time() + 10.0
            while any(per_request_state(decode, prefill, verify).values()):
                if asyncio.get_running_loop().time() > deadline:
                    break
                await asyncio.sleep(0.05)
            return made, per_request_state(decode, prefill, verify)
        finally:
            decode.engine.shutdown()

    made, state = asyncio.run(serve_and_look())
    assert made == 16 * 8
    assert state == dict.fromkeys(state, 0)
