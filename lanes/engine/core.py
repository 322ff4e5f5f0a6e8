"""The decode loop: draft, verify, append; prefill and verify reached through injected backends.

`step()` is schedule, run, postprocess (as in nano-vllm): draft + verify for every running request,
then a bounded amount of prefill. In the co-located modes (`EngineCore.colocated`) the backends are
the local lanes; the deployments inject proxies to other replicas for the disaggregated modes.
"""

import gc
import logging
import random
import time
from dataclasses import dataclass, field, replace
from functools import partial

import torch
from transformers import GenerationConfig, PreTrainedTokenizerBase

from lanes.device.fault import device_fault
from lanes.device.streams import LaneStreams, on
from lanes.engine.backends import KVLost, LaneOOM, LocalPrefiller, LocalVerifier, PendingResult, Prefiller, Verifier
from lanes.engine.outputs import RequestOutput
from lanes.engine.scheduler import Scheduler
from lanes.engine.sequence import SeqStatus, Sequence
from lanes.engine.step_cap import StepCap, free_cached_memory, is_oom
from lanes.engine.step_profile import StepProfile
from lanes.engine.step_trace import StepTrace, region
from lanes.kv.pool import KVPool, PoolFullError, PoolShape
from lanes.kv.sizing import num_kv_blocks
from lanes.model.families import check_supported
from lanes.model.forward_cost import forward_costs_ms
from lanes.model.loader import LoadedModel, check_compatible
from lanes.model.memory_profile import plan_memory
from lanes.model.runner import ModelRunner
from lanes.parallel.kv_handover import ShardedKVPool
from lanes.parallel.step import send_forward
from lanes.parallel.tensor_parallel import TPGroup, shard_model
from lanes.sample.detokenizer import IncrementalDetokenizer
from lanes.sample.grammar import Grammars
from lanes.sample.logprobs import TokenLogprobs
from lanes.sample.params import ParamError, SamplingParams
from lanes.sample.penalties import PenaltyHistory, check_request
from lanes.spec.draft import CATCH_UP_CHUNK, DraftLane, DraftProposal, Proposer, set_drafted_lengths, verify_bitmask
from lanes.spec.prefill import PrefillLane
from lanes.spec.rollback import rollback_after_verify
from lanes.spec.stats import SpecDecodeStats
from lanes.spec.verify import PendingVerify, VerifyBatch, VerifyLane, VerifyResult

log = logging.getLogger(__name__)


@dataclass
class EngineConfig:
    max_model_len: int = 1024  # prompt + output tokens per request
    max_num_seqs: int = 32  # requests admitted at once (block-table rows); memory is in blocks
    num_speculative_tokens: int = 4  # default draft length L
    max_draft_len: int = 8  # bound on any request's L (sizes the pool's slack)
    prefill_chunk_tokens: int = 512  # prefill budget per step while requests are decoding
    idle_prefill_tokens: int = 2048  # prefill budget per step when nothing is decoding
    attention_kernel: bool | None = None  # in-place pool attention for decode/verify (None: on CUDA)
    cuda_graphs: bool | None = None  # replay decode/verify forwards as CUDA graphs (None: with the kernel on CUDA)
    fused_layers: bool | None = None  # our fused Llama-family layers instead of HF's modules (None: where supported)
    block_size: int = 16  # tokens per KV block
    num_kv_blocks: int | None = None  # blocks per model pool (None: from gpu_memory_utilization on CUDA, else
    # max_num_seqs sequences of max_model_len)
    gpu_memory_utilization: float = 0.9  # share of the device's memory this lane's models and pools may use
    enable_prefix_caching: bool = True  # share the KV of full prompt blocks between requests
    # Plain speculative decoding (mode spec): no step both prefills and decodes, as in an engine
    # without chunked prefill (vLLM V0's default), and waiting prompts go first: while prompts wait
    # and requests decode, prefill-only and decode-only steps alternate, so at most one prefill forward
    # (of idle_prefill_tokens at most) runs between two decode steps. A burst of long prompts then
    # stalls decoding by one forward, not by the whole burst (seconds at 7B, issue 28); with nothing
    # decoding, prefill-only steps run back to back.
    prefill_first: bool = False
    # Times a request is recomputed on another replica when the verify replica holding its KV leaves
    # or dies (KVLost); once more fails it. 0: such a request fails at once.
    max_migrations: int = 3
    # Seconds a request whose KV a remote lane lost may go without a replica that holds it again (from
    # the start of the call that found the loss); then it fails. A lane whose only replica died gets no
    # replacement for tens of seconds (Serve's health check, then the replica's start): its requests end
    # with an error within this bound instead of holding their streams; with a replica left, or one
    # back in time, they are recomputed there (docs/serving.md).
    recover_within_s: float = 6.0
    # Times a request may meet a device out-of-memory error in a step already at its smallest size (one
    # decode row, one block of prefill) or in a remote lane, before it fails (lanes/engine/step_cap.py). Before
    # that it is recomputed, never failed.
    max_oom_attempts: int = 3
    lane_name: str = "engine"  # whose memory plan and refusals the log and errors name
    kv_copied_out: bool = False  # each prompt's KV is copied out of its blocks (the prefill lane's hand-over)
    # Launch the next decode step (its drafts, then its verify) before reading this one's tokens, where no
    # request needs them on the host first (no penalties, grammar or prompt lookup, nothing to admit): the
    # host's work between two steps then overlaps the device's (vLLM's async scheduling). EngineCore._launch_next.
    # On one H100 it shortened a step at 1 in flight by 10 % (nospec) and 6 % (spec), and served nospec and
    # unified 1.01-1.14x faster (benchmarks/results/async_scheduling_h100/).
    async_scheduling: bool = True
    fit_max_model_len: bool = False  # max_model_len was left unset: lower it to the longest that fits (CUDA)
    # "int8": the draft's linears read int8 weights with a scale per output channel (lanes/model/int8_linear.py),
    # half the bytes of a bf16 draft token; the output stays lossless, its acceptance may change. None: as loaded.
    draft_quantization: str | None = None

    def __post_init__(self):
        if not 0 <= self.num_speculative_tokens <= self.max_draft_len:
            raise ValueError("num_speculative_tokens must be in [0, max_draft_len]")
        if self.prefill_chunk_tokens < 1 or self.idle_prefill_tokens < self.prefill_chunk_tokens:
            raise ValueError("need 1 <= prefill_chunk_tokens <= idle_prefill_tokens")
        if self.max_num_seqs < 1 or self.max_model_len < 2:
            raise ValueError("max_num_seqs >= 1 and max_model_len >= 2 required")
        if self.block_size < 1 or not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("block_size >= 1 and 0 < gpu_memory_utilization <= 1 required")
        if self.max_migrations < 0 or self.recover_within_s <= 0:
            raise ValueError("max_migrations >= 0 and recover_within_s > 0 required")
        if self.max_oom_attempts < 1:
            raise ValueError("max_oom_attempts must be >= 1")
        if self.draft_quantization not in (None, "int8"):
            raise ValueError(f"draft_quantization must be None or 'int8', not {self.draft_quantization!r}")

    @property
    def slot_capacity_tokens(self) -> int:
        # Padded rows of a batched draft or catch-up forward write past their own length; leave
        # room for the widest (prefill splits its batch instead: PrefillLane._fit).
        return self.max_model_len + max(self.max_draft_len + 2, CATCH_UP_CHUNK)


@dataclass
class _InFlight:
    """A decode step launched and not read yet."""

    rows: list[Sequence]
    proposal: DraftProposal
    pending: PendingResult
    # Rows that finished (or were aborted) while this step could still write their KV blocks: their
    # slots go back once it has been read (EngineCore._finish).
    finished: list[Sequence] = field(default_factory=list)

    def holds(self, seq: Sequence) -> bool:
        return any(row is seq for row in self.rows)


class EngineCore:
    def __init__(
        self,
        config: EngineConfig,
        vocab_size: int,
        tokenizer: PreTrainedTokenizerBase | None,
        eos_ids: set[int],
        draft: ModelRunner | None,
        verifier: Verifier,
        prefiller: Prefiller,
        streams: LaneStreams | None = None,
        proposer: Proposer | None = None,
    ):
        """`draft`: the draft model's runner, whose KV this engine rolls back; `proposer`: what drafts
        (default: the draft model; an NgramProposer needs no draft model). Neither: no speculation."""
        self.config = config
        self.vocab_size = vocab_size
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.draft = draft
        self.proposer = proposer if proposer is not None else DraftLane(draft) if draft is not None else None
        self.verifier = verifier
        self.prefiller = prefiller
        self.streams = streams or LaneStreams(torch.device("cpu"))
        self.scheduler = Scheduler(verifier, draft.pool if draft is not None else None, getattr(verifier, "pool", None),
                                   config.max_num_seqs, config.enable_prefix_caching and prefiller.reuses_cached_blocks,
                                   config.max_draft_len + 1, draft_may_lag=prefiller.draft_may_lag)
        self.scheduler.holds_blocks, self.scheduler.forget = prefiller.holds_blocks, prefiller.forget
        self.default_draft_len = config.num_speculative_tokens if self.proposer is not None else 0
        self.total_stats = SpecDecodeStats()
        self.step_profile = StepProfile()  # steps by what they launched (benchmarks/stream_latency.py reads them)
        self.trace: StepTrace | None = None  # a torch.profiler trace of the next steps (lanes/engine/step_trace.py)
        self.num_migrations = 0  # requests recomputed because a remote lane lost their KV
        self._lost: dict[str, Sequence] = {}  # lost requests that no replica holds again yet (recover_within_s)
        # Rows and prefill tokens a step may carry: below the configured maxima after an out-of-memory error.
        self.step_cap = StepCap(config.max_num_seqs, config.idle_prefill_tokens, config.block_size)
        self.forward_ms: dict[str, dict[int, float]] = {}  # measure_forward_costs(): {model: {rows: ms}}
        self._row_cursor = 0  # where the next capped decode step starts in the running list
        self._prefilled_last = False  # prefill_first: the last step was prefill-only
        # Set when a failed batch left the device unusable (lanes/device/fault.py): the loop that
        # steps this engine stops, and the replica's health check fails.
        self.device_fault: str | None = None
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._in_flight: _InFlight | None = None  # async scheduling: a decode step launched, not read yet
        self.num_steps_ahead = 0  # decode steps launched before the step they follow was read
        self.grammars = Grammars(tokenizer, vocab_size, eos_ids)  # structured output; idle until a request asks

    @classmethod
    def colocated(
        cls,
        target: LoadedModel,
        draft: LoadedModel | None,
        config: EngineConfig,
        tokenizer: PreTrainedTokenizerBase | None = None,
        proposer: Proposer | None = None,
        allow_tokenizer_mismatch: bool = False,
        tp: TPGroup | None = None,
        shard_draft: bool = False,
    ) -> "EngineCore":
        """All three lanes in this process over its own pools (modes unified, spec, nospec).
        `proposer` drafts instead of a draft model (pass `draft=None` with it);
        `allow_tokenizer_mismatch`: see `check_compatible`. `tp`: this process is rank 0 of a
        tensor-parallel group whose workers run `lanes.parallel.worker.run_worker` over the same models and
        config: the target is sharded over it (in place), and the draft too with `shard_draft`."""
        assert draft is None or proposer is None, "a draft model or a proposer, not both"
        if draft is not None:
            check_compatible(draft, target, allow_tokenizer_mismatch)
        tokenizer = tokenizer if tokenizer is not None else target.tokenizer
        target_runner, draft_runner = build_runners(config, target.model, draft.model if draft is not None else None,
                                                    tp=tp, sharded=(True, shard_draft))
        # The pools may hold less than an unset max_model_len asked (build_runners): requests are checked
        # against what they hold.
        slack = config.slot_capacity_tokens - config.max_model_len
        config = replace(config, max_model_len=min(config.max_model_len,
                                                   target_runner.pool.shape.capacity_tokens - slack))
        streams = LaneStreams(target_runner.device, separate=tp is None)
        prefiller = LocalPrefiller(PrefillLane(target_runner, draft_runner, lazy_draft=True), streams.prefill)
        eos_ids = eos_token_ids(getattr(target.model, "generation_config", None), tokenizer)
        return cls(config, target_runner.vocab_size, tokenizer, eos_ids, draft_runner,
                   LocalVerifier(VerifyLane(target_runner)), prefiller, streams, proposer)

    def local_runners(self) -> dict[str, ModelRunner]:
        """The runners whose forwards run in this process: the target's where it verifies here
        (unified, spec, nospec, pd), and the draft's."""
        target = getattr(getattr(self.verifier, "lane", None), "runner", None)
        return {name: r for name, r in (("target", target), ("draft", self.draft)) if r is not None}

    def capture_graphs(self) -> float:
        """Capture the CUDA graphs of this engine's own forwards before it serves, so that no live
        step stalls on a first use (ModelRunner.capture_graphs): the target's forward at 1 to L + 1
        tokens (verify; fewer drafts near max_tokens, 1 with speculation off), the draft's 1- and
        2-token forwards, and whole-prompt prefill where prompts are prefilled here. Remote lanes
        capture their own; a draft length the controller raises past L captures on first use. Returns
        the ms spent."""
        runners = self.local_runners()
        prefill_here = self.prefiller.prefills_here
        spent_ms = 0.0
        if (target := runners.get("target")) is not None:
            spent_ms += target.capture_graphs(range(1, self.default_draft_len + 2), prefill=prefill_here)
        if (draft := runners.get("draft")) is not None:
            spent_ms += draft.capture_graphs({1, 2}, prefill=prefill_here)
        if spent_ms:
            log.info("captured the engine's CUDA graphs in %.1f s", spent_ms / 1e3)
        return spent_ms

    def measure_forward_costs(self) -> dict[str, dict[int, float]]:
        """Time a one-token forward of each local model over a batch (lanes/model/forward_cost.py), once,
        before serving: what the controller derives the drafter's relative cost from."""
        self.forward_ms = forward_costs_ms(self.local_runners())
        log.info("one-token forward, ms by rows: %s", self.forward_ms)
        return self.forward_ms

    # ---- requests -------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    arrival_s: float | None = None) -> Sequence:
        """Validate and queue a request. Raises ParamError naming the field; nothing is queued then.
        `arrival_s`: when it reached the server (wall clock; default now), for timelines."""
        params.validate()
        if request_id in self.scheduler.by_id:
            raise ParamError("request_id", f"{request_id!r} is already in flight")
        prompt_ids = self._prompt_ids(prompt)
        limit = self.config.max_model_len
        if len(prompt_ids) >= limit:
            raise ParamError("prompt", f"{len(prompt_ids)} tokens; the context holds {limit} (prompt + output)")
        if len(prompt_ids) + params.max_tokens > limit:
            raise ParamError(
                "max_tokens",
                f"prompt ({len(prompt_ids)}) + max_tokens ({params.max_tokens}) exceeds the context of {limit} tokens",
            )
        if any(t >= self.vocab_size for t in params.stop_token_ids):
            raise ParamError("stop_token_ids", f"token ids must be in [0, {self.vocab_size})")
        check_request(params, self.vocab_size, self.eos_ids)
        seed = params.seed if params.seed is not None else random.getrandbits(62)
        seq = Sequence(request_id, prompt_ids, params, seed, self.default_draft_len,
                       grammar=self.grammars.for_request(params))  # parsed now, compiled off the step loop
        if arrival_s is not None:
            seq.arrival_s = arrival_s
        self.scheduler.add(seq)
        if self.tokenizer is not None:
            self._detok[request_id] = IncrementalDetokenizer(self.tokenizer, params.stop, params.min_tokens)
        return seq

    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ParamError("prompt", "this engine has no tokenizer: send token ids")
            prompt = self.tokenizer.encode(prompt)
        if not isinstance(prompt, list) or not prompt:
            raise ParamError("prompt", "must be a non-empty string or list of token ids")
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < self.vocab_size for t in prompt):
            raise ParamError("prompt", f"token ids must be integers in [0, {self.vocab_size})")
        return prompt

    def abort(self, request_id: str) -> RequestOutput | None:
        seq = self.scheduler.by_id.get(request_id)
        if seq is None:
            return None
        self._finish(seq, "abort")
        return self._output(seq, [], "")

    def set_draft_lengths(self, default_len: int, per_request: dict[str, int] | None = None) -> None:
        """Change L (the controller's action). Bounded by max_draft_len; 0 turns speculation off."""
        bound = self.config.max_draft_len if self.proposer is not None else 0
        self.default_draft_len = max(0, min(default_len, bound))
        for seq in self.scheduler.by_id.values():
            wanted = (per_request or {}).get(seq.request_id, default_len)
            seq.draft_len = max(0, min(wanted, bound))

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or self.prefiller.has_replies or self._in_flight is not None

    # ---- one step -----------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        if self.trace is not None:
            self.trace.before_step()
        start_s, prefill_tokens = time.perf_counter(), self.scheduler.num_prefill_tokens
        outputs, rows = self._step()
        self.step_profile.observe(rows, self.scheduler.num_prefill_tokens - prefill_tokens,
                                  (time.perf_counter() - start_s) * 1e3)
        return outputs

    def _step(self) -> tuple[list[RequestOutput], int]:
        """One step's outputs, and how many running requests it decoded."""
        ooms = self.step_cap.num_oom_recoveries
        outputs, rows = self._step_ahead() if self._in_flight is not None else ([], None)
        if rows is None:
            scheduled, rows = self._scheduled_step()
            outputs += scheduled
        if self.step_cap.num_oom_recoveries == ooms:
            self.step_cap.observe_clean_step()
        return outputs, rows

    def _step_ahead(self) -> tuple[list[RequestOutput], int | None]:
        """With a decode step in flight: launch the one after it where nothing needs the host first,
        then read it. Returns its outputs, and its rows when the next step is in flight now (None: the
        caller schedules a step as usual, with nothing in flight)."""
        flight = self._in_flight
        self._in_flight = self._launch_next(flight)
        outputs = self._read(flight)
        return outputs, len(flight.rows) if self._in_flight is not None else None

    def _scheduled_step(self) -> tuple[list[RequestOutput], int]:
        with region("admit"):
            expired = self._expire_lost()
            self.scheduler.admit()
        # A prefill lane of its own (pd, pdv) takes no device time of this step: its replies are taken
        # in before drafting, so that a prompt whose KV landed while the last step verified decodes in
        # this step rather than the next, and a prompt admitted now goes to the lane before the drafting.
        # Before make_room, which then holds the blocks of those prompts' next tokens too.
        with region("take_in"):
            prefill_outputs = self._prefill_phase(self.prefiller.take_in, decoding=bool(self.scheduler.running))
        with region("make_room"):
            self.scheduler.make_room(self._tokens_after_step)
        outputs, launched = [], None
        prefill_only = self._prefill_turn()
        running = [] if prefill_only else self._decode_rows()
        if running:
            try:
                launched = self._launch_decode(running)
            except Exception as exc:
                outputs = self._on_error(running, exc, prefill=False)
        # Prefill work here is launched while the GPU (or the verify lane) verifies: its host-side launch
        # cost overlaps the verify step instead of adding to it. prefill_first never mixes the two.
        with region("prefill"):
            prefill_outputs += self._prefill_phase(self.prefiller.step, decoding=bool(running))
        if launched is not None:
            flight = _InFlight(running, *launched)
            self._in_flight = self._launch_next(flight)
            outputs += self._read(flight)
        self._prefilled_last = prefill_only
        # A prompt taken in before drafting has its first token out before the tokens it decoded here.
        return expired + prefill_outputs + outputs, len(running)

    def _prefill_phase(self, advance, decoding: bool) -> list[RequestOutput]:
        """Advance the prompts being prefilled by `advance` (the prefiller's `take_in` or `step`;
        `decoding`: requests decode in this step too)."""
        budget = min(self.config.prefill_chunk_tokens if decoding else self.config.idle_prefill_tokens,
                     self.step_cap.prefill_tokens)
        prefilling = list(self.scheduler.prefilling)
        self.scheduler.planned = []
        if self.config.prefill_first and decoding:
            return []
        if not (prefilling or self.prefiller.has_replies):  # replies of aborted requests give their slots back
            return []
        return self._guarded(prefilling, lambda: self._prefill(advance, budget, decoding=decoding), prefill=True)

    def _prefill_turn(self) -> bool:
        """prefill_first: whether this step prefills only. Prompts waiting go first, but not twice in a
        row while requests decode (EngineConfig.prefill_first)."""
        if not (self.config.prefill_first and self.scheduler.prefilling):
            return False
        return not (self._prefilled_last and self.scheduler.running)

    def _decode_rows(self) -> list[Sequence]:
        """The running requests this step decodes: all of them, unless an out-of-memory error capped the
        rows of a step; then a window of the cap's size that moves on each step, so every request advances."""
        running, cap = self.scheduler.running, self.step_cap.rows
        if len(running) <= cap:
            return list(running)
        start = self._row_cursor % len(running)
        self._row_cursor = start + cap
        return (running[start:] + running[:start])[:cap]

    def _tokens_after_step(self, seq: Sequence) -> int:
        """Tokens a running sequence's KV holds once this step's forwards wrote (the target's: the
        draft's is one fewer)."""
        return len(seq.token_ids) + (seq.step_draft_len(self.config.max_draft_len) if self.proposer else 0)

    def _guarded(self, seqs: list[Sequence], run, prefill: bool = False) -> list[RequestOutput]:
        try:
            return run()
        except Exception as exc:
            return self._on_error(seqs, exc, prefill)

    def _on_error(self, seqs: list[Sequence], exc: Exception, prefill: bool) -> list[RequestOutput]:
        return self._recover_oom(seqs, exc, prefill) if is_oom(exc) else self._fail(seqs, exc)

    def _recover_oom(self, seqs: list[Sequence], exc: Exception, prefill: bool) -> list[RequestOutput]:
        """The step's activations did not fit: free what it held, recompute its requests (they keep their
        tokens; preemption rebuilds their KV, draft and rollback state included), and make the next
        steps smaller. Not a device fault: the device still runs work."""
        at_min = self.step_cap.at_min(prefill)
        free_cached_memory(self.streams.device)
        self.step_cap.shrink(None if prefill else len(seqs))
        log.warning("out of device memory in a %s step of requests %s; recomputing them, next steps at most "
                    "%d rows and %d prefill tokens: %s", "prefill" if prefill else "decode",
                    [s.request_id for s in seqs], self.step_cap.rows, self.step_cap.prefill_tokens, exc)
        # A prefill step preempts every prompt it was advancing, but counts the attempt only against those
        # its failed forward carried.
        carried = self.scheduler.planned if prefill else seqs
        outputs = []
        for seq in seqs:
            if seq.finish_reason is None and seq.status is not SeqStatus.WAITING:
                outputs += self._recompute_after_oom(seq, counts=at_min and seq in carried)
        return outputs

    def _recompute_after_oom(self, seq: Sequence, counts: bool) -> list[RequestOutput]:
        """Preempt `seq` for recompute; `counts`: the error met it at the smallest step size (or in a
        remote lane), and after max_oom_attempts of those it fails, so that it cannot loop forever."""
        seq.num_ooms += counts
        if seq.num_ooms < self.config.max_oom_attempts:
            self.scheduler.preempt(seq)
            return []
        log.error("request %s: out of device memory %d times at the smallest step size; failing it",
                  seq.request_id, seq.num_ooms)
        self._finish(seq, "error")
        return [self._output(seq, [], "", error=f"out of device memory {seq.num_ooms} times at the smallest step")]

    def _fail(self, seqs: list[Sequence], exc: Exception) -> list[RequestOutput]:
        # A failing batch fails its own requests and frees their slots; the engine keeps serving.
        log.exception("engine step failed for requests %s", [s.request_id for s in seqs])
        self.device_fault = self.device_fault or device_fault(self.streams.device)
        outputs = []
        for seq in seqs:
            if seq.finish_reason is None:
                self._finish(seq, "error")
                outputs.append(self._output(seq, [], "", error=f"{type(exc).__name__}: {exc}"))
        return outputs

    def _launch_decode(self, running: list[Sequence]) -> tuple[DraftProposal, PendingResult]:
        """Draft, and launch the verify step without waiting for it."""
        max_draft = self.config.max_draft_len
        draft_lens = [s.step_draft_len(max_draft) for s in running] if self.proposer else [0] * len(running)
        self.streams.decode_after_current()  # verify follows decode, so it is ordered after them too
        with on(self.streams.decode), region("draft"):
            proposal = self._propose(running, draft_lens)
        with region("verify_launch"):
            return proposal, self._launch_verify(running, proposal)

    def _launch_verify(self, running: list[Sequence], proposal: DraftProposal) -> PendingResult:
        token_bitmask = verify_bitmask(running, proposal)  # None unless a row has a grammar
        batch = VerifyBatch(
            target_slots=[s.target_slot for s in running],
            num_tokens=[len(s.token_ids) for s in running],
            last_tokens=[s.token_ids[-1] for s in running],
            draft_tokens=proposal.tokens,
            draft_probs=proposal.probs,
            num_draft=proposal.num_draft,
            params=[s.params for s in running],
            seeds=[s.seed for s in running],
            target_leases=[s.target_lease for s in running],
            history=PenaltyHistory.of(running),
            token_bitmask=token_bitmask,
        )
        self.streams.verify_after_decode()
        with on(self.streams.verify):
            return self.verifier.launch(batch)

    def _launch_next(self, flight: _InFlight) -> _InFlight | None:
        """Async scheduling: the decode step after `flight`, launched before `flight` is read, or None
        where the host must read `flight` first. It goes ahead only when it would decode the same rows
        with nothing else to schedule (nothing waiting, prefilling or lost) and each row's next step is
        known without its tokens on the host (`_next_draft_len`). A row that ends in `flight` (EOS, a stop
        string, an abort) wastes its next step's tokens, which are dropped, and keeps its blocks until that
        step is read (`_finish`). The whole step runs on the verify stream, after `flight` there."""
        rows, scheduler = flight.rows, self.scheduler
        ready = (self.config.async_scheduling and isinstance(flight.pending, PendingVerify)  # a local verify step
                 and len(rows) <= self.step_cap.rows
                 and len(rows) == len(scheduler.running) and all(a is b for a, b in zip(rows, scheduler.running))
                 and not (scheduler.waiting or scheduler.prefilling or self.prefiller.has_replies or self._lost))
        draft_lens = [self._next_draft_len(s, n) for s, n in zip(rows, flight.proposal.num_draft)] if ready else [None]
        if None in draft_lens or (any(draft_lens) and not all(draft_lens)):
            return None
        num_tokens = [len(s.token_ids) for s in rows]  # T before `flight`'s tokens
        try:
            with on(self.streams.verify):
                with region("draft"):
                    proposal = (self.proposer.propose_ahead(rows, draft_lens, flight.pending, num_tokens)
                                if any(draft_lens) else self._propose(rows, draft_lens))
                with region("verify_launch"):
                    batch = VerifyBatch([s.target_slot for s in rows], None, None, proposal.tokens, proposal.probs,
                                        proposal.num_draft, [s.params for s in rows], [s.seed for s in rows],
                                        [s.target_lease for s in rows])
                    pending = flight.pending.launch_next(batch, num_tokens)
        except Exception as exc:
            # Its blocks do not fit (PoolFullError), or it failed (out of memory, a device fault): `flight` is
            # read first and the step is scheduled as usual, where make_room or the step's own error handling
            # (recompute after an OOM, fail the batch, find the device fault) deals with it.
            if not isinstance(exc, PoolFullError):
                log.warning("a decode step launched ahead failed (%s: %s); it is scheduled again once the step "
                            "in flight is read", type(exc).__name__, exc)
            return None
        self.num_steps_ahead += 1
        return _InFlight(rows, proposal, pending)

    def _next_draft_len(self, seq: Sequence, num_draft: int) -> int | None:
        """The drafts `seq` proposes in the step after one of `num_draft` drafts, where that is known before
        the step is read; else None. Not known with penalties or a grammar (they need the step's tokens on
        the host), with drafts from prompt lookup or a draft cache that did not draft in that step, or
        near max_tokens, where the next step's drafts would depend on how many are accepted."""
        if seq.finish_reason is not None or seq.grammar is not None or seq.params.penalised:
            return None
        draft_len = min(seq.draft_len, self.config.max_draft_len) if self.proposer is not None else 0
        if draft_len and not (num_draft and isinstance(self.proposer, DraftLane)):
            return None
        return draft_len if seq.remaining_tokens >= num_draft + draft_len + 2 else None

    def _read(self, flight: _InFlight) -> list[RequestOutput]:
        """Read a decode step launched earlier, append its tokens, and give back the slots of the rows
        that finished while it was in flight."""
        outputs = self._guarded(flight.rows, lambda: self._finish_decode(flight.rows, flight.proposal, flight.pending))
        for seq in flight.finished:
            self.scheduler.release_slots(seq)
        return outputs

    def _finish_decode(self, running: list[Sequence], proposal: DraftProposal, pending: PendingResult
                       ) -> list[RequestOutput]:
        """Read the verify step's result, roll the draft cache back, and append what was accepted."""
        num_tokens = [len(s.token_ids) for s in running]
        with region("verify_wait"):
            result = pending.result()
        if self.draft is not None:
            slots = [s.draft_slot for s in running]
            with region("rollback"):
                if proposal.ahead:  # drafted before T was known on the host
                    set_drafted_lengths(self.draft.pool, slots, num_tokens, proposal.num_draft)
                rollback_after_verify(self.draft.pool, slots, num_tokens, result.num_accepted)
        with region("append"):
            return self._append_verified(running, proposal, result)

    def _append_verified(self, running: list[Sequence], proposal: DraftProposal, result: VerifyResult
                         ) -> list[RequestOutput]:
        outputs = []
        logprobs = result.logprobs or [None] * len(running)
        errors = result.errors or [None] * len(running)
        for seq, num_draft, tokens, num_accepted, lp, error in zip(running, proposal.num_draft, result.tokens,
                                                                   result.num_accepted, logprobs, errors):
            if seq.finish_reason is not None:  # ended while this step was in flight: its token is dropped
                continue
            if error is not None:
                outputs += self._remote_error(seq, error, "verify")
                continue
            seq.stats.observe(num_draft, num_accepted)
            self.total_stats.observe(num_draft, num_accepted)
            outputs.append(self._append(seq, tokens, lp))
        return outputs

    def _remote_error(self, seq: Sequence, error: BaseException, stage: str) -> list[RequestOutput]:
        """What a remote lane's failure of one request becomes: a recompute where load or a lost
        replica caused it (out of KV blocks, KV lost, out of device memory at its smallest retry),
        else an error of this request only."""
        if isinstance(error, PoolFullError):
            self.scheduler.preempt(seq)  # queued again, never failed
            return []
        if isinstance(error, KVLost) and self._migrate(seq, error):
            return []
        if isinstance(error, LaneOOM):
            return self._recompute_after_oom(seq, counts=True)
        self._finish(seq, "error")
        return [self._output(seq, [], "", error=f"{stage} failed: {type(error).__name__}: {error}",
                             lane_lost=isinstance(error, KVLost))]

    def _migrate(self, seq: Sequence, lost: KVLost) -> bool:
        """Recompute a request whose KV a remote lane lost (its verify replica was scaled down or
        died) on whichever replica its next prefill reaches, as a preemption does: it keeps every token,
        and its output goes on where it stopped. False once it has moved `max_migrations` times (a
        request that kills each replica it lands on must not take the whole lane down), or has been
        lost for `recover_within_s` (no replica takes it: `_expire_lost`)."""
        now_s = time.monotonic()
        if seq.lost_s is None:  # the first loss of this outage: no replica has held it since its call began
            seq.lost_s = now_s - lost.waited_s
        if seq.num_migrations >= self.config.max_migrations or now_s - seq.lost_s >= self.config.recover_within_s:
            return False
        self._lost[seq.request_id] = seq
        seq.num_migrations += 1
        self.num_migrations += 1
        log.info("request %s: %s; recomputing it elsewhere (move %d of at most %d)", seq.request_id, lost,
                 seq.num_migrations, self.config.max_migrations)
        self.scheduler.preempt(seq)
        return True

    def _expire_lost(self) -> list[RequestOutput]:
        """Fail the lost requests that no replica has taken back within `recover_within_s`: their
        streams end with an error now rather than when the lane comes back. One whose prompt is at the
        prefill lane is dropped as an abort is (its reply, when it comes, frees what it took)."""
        if not self._lost:
            return []
        now_s, outputs = time.monotonic(), []
        for seq in [s for s in self._lost.values() if now_s - s.lost_s >= self.config.recover_within_s]:
            log.warning("request %s: its KV was lost %.1f s ago and no replica took it back; failing it",
                        seq.request_id, now_s - seq.lost_s)
            self._finish(seq, "error")
            outputs.append(self._output(seq, [], "", error=f"its KV was lost and no replica took it back within "
                                                           f"{self.config.recover_within_s:g} s", lane_lost=True))
        return outputs

    def _propose(self, running: list[Sequence], draft_lens: list[int]) -> DraftProposal:
        if self.proposer is None or not any(draft_lens):
            device = self.draft.device if self.draft is not None else "cpu"
            return DraftProposal.empty(len(running), device)
        return self.proposer.propose(running, draft_lens)

    def _prefill(self, advance, budget_tokens: int, decoding: bool) -> list[RequestOutput]:
        outputs = []
        for seq, first, logprobs in advance(self.scheduler, budget_tokens, decoding):
            if isinstance(first, BaseException):
                outputs += self._remote_error(seq, first, "prefill")
                continue
            if self._lost.pop(seq.request_id, None) is not None:
                seq.lost_s = None  # a replica holds its KV again
            if seq.resumed:
                seq.prompt_logprobs = None  # KV recomputed after a preemption: its next token is known already
                continue
            if seq.params.max_tokens == 0:  # scoring: the prompt's logprobs were the whole answer
                self._finish(seq, "length")
                outputs.append(self._output(seq, [], "", prompt_logprobs=seq.prompt_logprobs))
            else:
                outputs.append(self._append(seq, [first], logprobs, seq.prompt_logprobs))
            seq.prompt_logprobs = None  # sent with its first chunk
        return outputs

    # ---- postprocess --------------------------------------------------------------------

    def _append(self, seq: Sequence, new_tokens: list[int], logprobs: TokenLogprobs | None = None,
                prompt_logprobs: TokenLogprobs | None = None) -> RequestOutput:
        """Append a step's tokens (with their logprobs, when asked), stopping at EOS, a stop token,
        max_tokens or a stop string."""
        params, reason, emitted, visible = seq.params, None, [], []
        for token in new_tokens:
            seq.token_ids.append(token)
            emitted.append(token)
            if token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_ids):
                reason = "stop"
                break
            visible.append(token)
            if seq.num_output_tokens >= params.max_tokens:
                reason = "length"
                break
        if seq.grammar is not None and seq.grammar.commit(emitted):  # the matcher rolls back with the KV
            reason = "stop"
        text = ""
        detok = self._detok.get(seq.request_id)
        if detok is not None:
            text, hit_stop = detok.append(visible)
            if hit_stop:
                reason = "stop"
                # Tokens after the one that completed the stop string (same step) are not output.
                del seq.token_ids[len(seq.token_ids) - len(emitted) + detok.consumed :]
                emitted = emitted[: detok.consumed]
            elif reason is not None:
                text += detok.flush()
        if reason is not None:
            self._finish(seq, reason)
        return self._output(seq, emitted, text, logprobs=logprobs.head(len(emitted)) if logprobs is not None else None,
                            prompt_logprobs=prompt_logprobs)

    def _finish(self, seq: Sequence, reason: str) -> None:
        # A decode step in flight may still write this row's blocks: they must not go to another request
        # (whose prefill, on another stream, could be overwritten) before that step has been read.
        flight = self._in_flight
        in_flight = flight is not None and flight.holds(seq) and seq.status is SeqStatus.RUNNING
        self.scheduler.finish(seq, reason, keep_slots=in_flight)
        if in_flight:
            flight.finished.append(seq)
        self._detok.pop(seq.request_id, None)
        self._lost.pop(seq.request_id, None)

    def _output(self, seq: Sequence, tokens: list[int], text: str, error: str | None = None,
                logprobs: TokenLogprobs | None = None, prompt_logprobs: TokenLogprobs | None = None,
                lane_lost: bool = False) -> RequestOutput:
        return RequestOutput(
            request_id=seq.request_id,
            token_ids=tokens,
            text=text,
            finished=seq.finish_reason is not None,
            finish_reason=seq.finish_reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=seq.num_output_tokens,
            # A finished sequence's counters no longer change, so the final chunk can carry them uncopied.
            stats=seq.stats if seq.finish_reason is not None else None,
            error=error,
            lane_lost=lane_lost,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            num_cached_tokens=seq.num_cached_tokens,
        )


def build_runner(model: torch.nn.Module, config: EngineConfig, draft: bool = False) -> ModelRunner:
    return build_runners(config, model, draft_index=0 if draft else None)[0]


def build_runners(config: EngineConfig, *models: torch.nn.Module | None, tp: TPGroup | None = None,
                  sharded: tuple[bool, ...] = (), draft_index: int | None = 1) -> list[ModelRunner | None]:
    """A runner per model (None stays None), over pools of one block count, sized together.

    `tp`: the tensor-parallel group of this process; the models flagged in `sharded` (by position)
    are cut to this rank's shard in place and moved to its device, their pools hold its KV heads, and
    on rank 0 their forwards are sent to the workers under their position (lanes/parallel/step.py). Every
    rank of the group must call this with the same config and models. `draft_index`: the position
    of the draft model, whose catch-up forwards the memory profile runs too."""
    present = [m for m in models if m is not None]
    for model in present:  # models built elsewhere (tests, benchmarks) reach the engine without load_model's check
        check_supported(model.config, config.slot_capacity_tokens)
    groups = [tp if tp is not None and i < len(sharded) and sharded[i] else None for i in range(len(models))]
    for model, group in zip(models, groups):
        if model is not None and group is not None:
            shard_model(model, group)
            model.to(group.device)  # a model too large for one device loads on the host and moves as a shard
    shapes = {i: _pool_shape(m, g, config) for i, (m, g) in enumerate(zip(models, groups)) if m is not None}
    device = next(present[0].parameters()).device
    dtypes = [m.dtype for m in present]
    if device.type == "cuda" and config.num_kv_blocks is None:
        # The pools start with one sequence's blocks, the profile runs over them, and they are resized
        # to what it leaves (lanes/kv/sizing.py).
        runners = _runners(models, groups, shapes, next(iter(shapes.values())).blocks_per_slot, device, config,
                           draft_index)
        live = [r for r in runners if r is not None]
        draft = runners[draft_index] if draft_index is not None and draft_index < len(runners) else None
        plan = plan_memory(live, config, live.index(draft) if draft is not None else None)
        fitted = plan.longest_context_tokens()
        if config.fit_max_model_len and tp is None and 2 <= fitted < config.max_model_len:
            log.info("%s: max_model_len unset, and one sequence of the model's %d tokens does not fit: it is %d, "
                     "the longest that does", config.lane_name, config.max_model_len, fitted)
            del runners, live, draft
            gc.collect()  # runner <-> fused decoder cycles hold the one-sequence pools until collected
            torch.cuda.empty_cache()
            return build_runners(replace(config, max_model_len=fitted, fit_max_model_len=False), *models,
                                 draft_index=draft_index)
        blocks = num_kv_blocks(list(shapes.values()), dtypes, device, config.max_num_seqs, None, plan)
    else:
        blocks = num_kv_blocks(list(shapes.values()), dtypes, device, config.max_num_seqs, config.num_kv_blocks)
        runners = _runners(models, groups, shapes, blocks, device, config, draft_index)
    if tp is not None:  # block tables name the same blocks on every rank
        blocks = tp.min_over_ranks(blocks)
    for runner in runners:
        if runner is not None and runner.pool.shape.num_blocks != blocks:
            runner.pool.resize(blocks)
    return runners


def _runners(models, groups, shapes, blocks: int, device, config: EngineConfig,
             draft_index: int | None) -> list[ModelRunner | None]:
    return [None if m is None else _runner(m, shapes[i], blocks, device, config, g, i, i == draft_index)
            for i, (m, g) in enumerate(zip(models, groups))]


def _pool_shape(model: torch.nn.Module, tp: TPGroup | None, config: EngineConfig) -> PoolShape:
    shape = PoolShape.for_model(model.config, config.max_num_seqs, config.slot_capacity_tokens, config.block_size)
    return shape if tp is None else replace(shape, num_kv_heads=shape.num_kv_heads // tp.size)


def _runner(model: torch.nn.Module, shape: PoolShape, blocks: int, device, config: EngineConfig, tp: TPGroup | None,
            index: int, is_draft: bool) -> ModelRunner:
    shape = replace(shape, num_blocks=blocks)
    rank0 = tp is not None and tp.rank == 0
    share = partial(send_forward, tp, index) if rank0 else None
    # Rank 0's pool reads and writes a hand-over's KV over every rank's heads (lanes/parallel/kv_handover.py).
    pool = ShardedKVPool(shape, model.dtype, device, tp, index) if rank0 else KVPool(shape, model.dtype, device)
    return ModelRunner(model, pool, config.attention_kernel, config.cuda_graphs, config.fused_layers, tp, share,
                       int8_weights=is_draft and config.draft_quantization == "int8")


def eos_token_ids(generation_config: GenerationConfig | None, tokenizer: PreTrainedTokenizerBase | None) -> set[int]:
    ids: set[int] = set()
    eos = getattr(generation_config, "eos_token_id", None)
    if eos is not None:
        ids.update(eos if isinstance(eos, list) else [eos])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids
