"""Verify lane: the target scores every sequence's drafts in ONE forward and applies the rejection rule."""

import torch

from lanes.draft import DraftProposal
from lanes.model_runner import ModelRunner
from lanes.rejection import RejectionOutput, rejection_sample
from lanes.sampling import STREAM_ACCEPT, STREAM_TARGET, SamplingTensors, logits_to_probs, uniform_noise
from lanes.sequence import Sequence


class VerifyLane:
    def __init__(self, runner: ModelRunner):
        self.runner = runner

    def verify(self, seqs: list[Sequence], proposal: DraftProposal, st: SamplingTensors) -> RejectionOutput:
        """Score [last token, drafts...] for every row; returns accepted tokens on the device.

        With no drafts (L = 0 everywhere) this is one ordinary decode step of the target.
        """
        device = self.runner.device
        pool = self.runner.pool
        slots = [s.target_slot for s in seqs]
        kv_lens = [pool.lengths[slot] for slot in slots]
        assert all(n == len(s.token_ids) - 1 for n, s in zip(kv_lens, seqs)), "target must lag by exactly one token"
        last = torch.tensor([[s.token_ids[-1]] for s in seqs], dtype=torch.long).to(device, non_blocking=True)
        ids = torch.cat([last, proposal.tokens.to(device)], dim=1)  # [B, L + 1]
        logits = self.runner.forward(slots, ids, kv_lens)  # [B, L + 1, V]
        p = logits_to_probs(logits, st)
        max_draft = proposal.tokens.shape[1]
        # Row b's token at column c lands at absolute position len(token_ids) + c.
        positions = torch.tensor([[len(s.token_ids)] for s in seqs], device=device) + torch.arange(max_draft + 1, device=device)
        out = rejection_sample(
            proposal.tokens.to(device),
            proposal.probs.to(device),
            p,
            proposal.num_draft.to(device),
            uniform_noise(st.seeds, positions[:, :max_draft], STREAM_ACCEPT),
            uniform_noise(st.seeds, positions, STREAM_TARGET, p.shape[-1]),
        )
        for slot, s, n in zip(slots, seqs, proposal.num_draft_host):
            pool.lengths[slot] = len(s.token_ids) + n  # written and possibly valid; rollback trims
        return out
