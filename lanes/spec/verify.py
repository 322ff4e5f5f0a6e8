"""Verify lane: the target scores every sequence's drafts in ONE forward and applies the rejection rule.

The lane owns the target's KV pool. Its input is a `VerifyBatch` (token ids and draft
probabilities, the only things that travel from the decode lane) and its output is host lists.
Per step: one host-to-device copy of the rows' inputs, one device-to-host copy of the result, and
the pool's lengths set for the whole batch at once.
"""

from dataclasses import dataclass

import numpy as np
import torch

from lanes.device.batching import HostCopy, to_device, to_host_async
from lanes.model.runner import ModelRunner, Rows
from lanes.sample.grammar import apply_token_bitmask
from lanes.sample.logprobs import TokenLogprobs, batch_k, pack, unpack
from lanes.sample.params import SamplingParams
from lanes.sample.penalties import Penalties, PenaltyHistory
from lanes.sample.sampling import STREAM_ACCEPT, STREAM_TARGET, SamplingTensors, logits_to_probs, uniform_noise
from lanes.spec.rejection import RejectionOutput, greedy_verify, point_mass, rejection_sample
from lanes.spec.rollback import rollback_after_verify


@dataclass
class VerifyBatch:
    target_slots: list[int]
    # T per row: committed tokens, the last of which the target has not seen. None for a step launched
    # before the step it follows was read (VerifyLane.launch_after): the target's pool holds T - 1 once
    # that one has been read, and its last tokens are on the device.
    num_tokens: list[int] | None
    last_tokens: list[int] | None
    # [B, L] int64. Over a verify channel on one device, a DraftRef in transit: the slot of the engine's ring
    # that holds them (lanes/device/shared_drafts.py), turned back into a tensor by the verify replica.
    draft_tokens: torch.Tensor
    draft_probs: torch.Tensor | None  # [B, L, V] q; None when q is one-hot at every draft (greedy, lookup)
    num_draft: list[int]  # drafts per row, 0 <= n <= L
    params: list[SamplingParams]
    seeds: list[int]
    target_leases: list[str | None] | None = None  # per row: the remote pool instance that holds the slot
    history: PenaltyHistory | None = None  # the tokens of the rows that use penalties; None when none does
    # [B, L + 1, ceil(V / 32)] int32 on the host: column c's allowed tokens after drafts[:c], for rows
    # with a grammar (all bits set for the others); None when no row has one (lanes/sample/grammar.py).
    token_bitmask: torch.Tensor | None = None

    def to(self, device) -> "VerifyBatch":
        return VerifyBatch(
            self.target_slots, self.num_tokens, self.last_tokens, self.draft_tokens.to(device),
            None if self.draft_probs is None else self.draft_probs.to(device), self.num_draft, self.params, self.seeds,
            self.target_leases, self.history, self.token_bitmask,
        )

    def select(self, rows: list[int]) -> "VerifyBatch":
        """The sub-batch of these rows, in this order (a remote verifier splits a batch by owner)."""
        index = torch.tensor(rows, dtype=torch.long, device=self.draft_tokens.device)

        def pick(values: list | None) -> list | None:
            return None if values is None else [values[r] for r in rows]

        return VerifyBatch(
            pick(self.target_slots), pick(self.num_tokens), pick(self.last_tokens), self.draft_tokens[index],
            None if self.draft_probs is None else self.draft_probs[index], pick(self.num_draft), pick(self.params),
            pick(self.seeds), pick(self.target_leases), self.history and self.history.select(rows),
            None if self.token_bitmask is None else self.token_bitmask[rows],
        )


@dataclass
class VerifyResult:
    tokens: list[list[int]]  # per row: accepted drafts then the recovered or bonus token
    num_accepted: list[int]
    # Per row, the logprobs of its tokens (None for a row that did not ask); None when no row asked.
    logprobs: list[TokenLogprobs | None] | None = None
    # Per row, why it was not verified (its remote verifier failed: it has no tokens); None when every
    # row was. A KVLost or PoolFullError row is recomputed, any other fails its request alone.
    errors: list[Exception | None] | None = None


@dataclass
class PendingVerify:
    """A verify step launched on the device, its result not read yet (`VerifyLane.launch`)."""

    lane: "VerifyLane"
    batch: VerifyBatch
    k: int | None  # top logprobs packed per column, None when no row asked
    width: int  # L + 1 columns
    copy: HostCopy
    # On the device, for a step launched after this one before it is read (VerifyLane.launch_after):
    rows: Rows  # the target's slots and each row's T - 1
    inputs: torch.Tensor  # [B, L + 1] the last committed token, then the drafts
    num_draft: torch.Tensor  # [B]
    out: RejectionOutput  # what `copy` brings back

    def result(self) -> VerifyResult:
        """Wait for the copy, then set the pool's lengths and roll rejected drafts back."""
        return self.lane._finish(self, self.copy.wait())

    def launch_next(self, batch: VerifyBatch, num_tokens: list[int]) -> "PendingVerify":
        """The verify step after this one, launched before this one is read (VerifyLane.launch_after)."""
        return self.lane.launch_after(self, batch, num_tokens)


class VerifyLane:
    def __init__(self, runner: ModelRunner):
        self.runner = runner

    @property
    def pool(self):
        return self.runner.pool

    def rows_that_fit(self, batch: VerifyBatch) -> list[int]:
        """The rows, in order, whose drafts the pool's free blocks can back now (`launch` reserves
        them all or none). A merged batch too big for the pool then verifies these and sheds the
        rest, instead of failing whole. Host-side; one vector sum unless the pool is short."""
        need = self.pool.blocks_short(batch.target_slots, np.add(batch.num_tokens, batch.num_draft))
        free = self.pool.num_free_blocks
        if need.sum() <= free:
            return list(range(len(need)))
        fit = []
        for row, blocks in enumerate(need.tolist()):  # first come, first served
            if blocks <= free:
                fit.append(row)
                free -= blocks
        return fit

    def verify(self, batch: VerifyBatch) -> VerifyResult:
        """Score [last token, drafts...] of every row in one forward, accept by the rejection rule,
        and roll the target cache back to the committed tokens. With no drafts this is one
        ordinary decode step of the target."""
        return self.launch(batch).result()

    def launch(self, batch: VerifyBatch) -> "PendingVerify":
        """`verify` up to its one device-to-host copy, queued without waiting for it, so that the
        engine can launch other work (a prefill chunk) while the GPU verifies. Nothing reads the
        result or touches the pool's lengths until `PendingVerify.result()`."""
        slots, num_tokens = batch.target_slots, batch.num_tokens
        kv_lens = np.subtract(num_tokens, 1)
        assert (self.pool.lengths[slots] == kv_lens).all(), "target must lag by exactly one token"
        slot_ids, starts, last, num_draft = to_device([slots, kv_lens.tolist(), batch.last_tokens, batch.num_draft],
                                                      torch.long, self.runner.device)
        self.pool.reserve(slots, np.add(num_tokens, batch.num_draft))  # the real drafts; padding writes no block
        return self._launch(batch, Rows(slot_ids, starts, int(kv_lens.max())), last, num_draft)

    def launch_after(self, pending: "PendingVerify", batch: VerifyBatch, num_tokens: list[int]) -> "PendingVerify":
        """Async scheduling: verify `batch` (the rows of `pending`, in its order, with their next drafts)
        before `pending` is read, so that the host's work and launch overlap `pending` on the device
        instead of following it. Each row's T and last token are what `pending` commits, taken on the
        device; the stream orders the two steps. `num_tokens`: T per row before `pending`, which bounds
        the positions on the host (a row commits at most its drafts + 1)."""
        assert batch.num_tokens is None and batch.target_slots == pending.batch.target_slots
        accepted = pending.out.num_accepted
        last = pending.out.tokens.gather(1, accepted[:, None])[:, 0]  # [B] the recovered or bonus token
        starts = pending.rows.starts + accepted + 1  # T' - 1 = T + k
        most = np.add(num_tokens, pending.batch.num_draft)  # the largest T' - 1
        self.pool.reserve(batch.target_slots, most + 1 + np.asarray(batch.num_draft))
        num_draft = to_device(batch.num_draft, torch.long, self.runner.device)
        return self._launch(batch, Rows(pending.rows.slot_ids, starts, int(most.max())), last, num_draft)

    def _launch(self, batch: VerifyBatch, rows: Rows, last: torch.Tensor, num_draft: torch.Tensor
                ) -> "PendingVerify":
        device, starts = self.runner.device, rows.starts
        st = SamplingTensors.build(batch.params, batch.seeds, device)
        drafts = batch.draft_tokens.to(device)
        ids = torch.cat([last[:, None], drafts], dim=1)  # [B, L + 1]
        logits = self.runner.forward(rows, ids)  # [B, L + 1, V]
        if batch.token_bitmask is not None:  # structured output: p is the masked target
            logits = apply_token_bitmask(logits, batch.token_bitmask)
        # Penalised target: column c counts the drafts before it (lanes/sample/penalties.py). Logprobs stay raw.
        penalties = Penalties.build(batch.params, batch.history, logits.shape[-1], device)
        scores = logits if penalties is None else penalties.apply(logits, drafts)
        if st.all_greedy:
            out = greedy_verify(drafts, scores, num_draft)
        else:
            out = self._sample(scores, drafts, batch.draft_probs, num_draft, starts + 1, st)
        # The step's single device-to-host transfer: accepted tokens, their count per row, and the
        # logprobs of every column (only when a row asked for them).
        k = batch_k([p.logprobs for p in batch.params])
        columns = [out.tokens, out.num_accepted[:, None]]
        if k is not None:
            columns.append(pack(logits, out.tokens, k))  # [B, (L + 1) * (1 + 2k)]
        return PendingVerify(self, batch, k, ids.shape[1], to_host_async(torch.cat(columns, dim=1)), rows, ids,
                             num_draft, out)

    def _finish(self, pending: "PendingVerify", host: torch.Tensor) -> VerifyResult:
        batch, k, width = pending.batch, pending.k, pending.width
        slots, num_tokens = batch.target_slots, batch.num_tokens
        if num_tokens is None:  # launched ahead: the step before it has been read, and the pool holds T - 1
            num_tokens = self.pool.lengths[slots] + 1
        accepted = host[:, width].numpy()
        self.pool.lengths[slots] = np.add(num_tokens, batch.num_draft)  # what this forward wrote for the real drafts
        rollback_after_verify(self.pool, slots, num_tokens, accepted)
        emitted = (accepted + 1).tolist()
        tokens = [row[:n] for row, n in zip(host[:, :width].tolist(), emitted)]
        return VerifyResult(tokens, accepted.tolist(), None if k is None else self._logprobs(host[:, width + 1 :], k,
                                                                                             batch.params, emitted))

    @staticmethod
    def _logprobs(packed: torch.Tensor, k: int, params: list[SamplingParams], emitted: list[int]
                  ) -> list[TokenLogprobs | None]:
        # Column c of a row holds the target's logprobs at the position of its c-th emitted token.
        return [None if p.logprobs is None else unpack(row, k, 0, n, p.logprobs)
                for row, p, n in zip(packed, params, emitted)]

    def _sample(self, logits, drafts, draft_probs, num_draft, num_tokens: torch.Tensor, st: SamplingTensors):
        device = logits.device
        p = logits_to_probs(logits, st)  # [B, L + 1, V]
        max_draft = drafts.shape[1]
        if draft_probs is None:  # greedy drafting rows or prompt lookup: q is one-hot at the drafted token
            draft_probs = point_mass(drafts, p.shape[-1], p.dtype)
        # Row b's token at column c lands at absolute position T_b + c.
        positions = num_tokens[:, None] + torch.arange(max_draft + 1, device=device)
        return rejection_sample(
            drafts, draft_probs.to(device), p, num_draft,
            uniform_noise(st.seeds, positions[:, :max_draft], STREAM_ACCEPT),
            uniform_noise(st.seeds, positions, STREAM_TARGET, p.shape[-1]),
        )
