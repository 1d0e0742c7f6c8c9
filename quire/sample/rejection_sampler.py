"""Rejection sampling for speculative decoding (Leviathan et al. 2023; Chen et al. 2023): the
tokens a request emits from a draft's proposals are distributed exactly as the target's samples.

Per request, the draft proposed x_1..x_k, drawing x_j from its distribution q_j; the target's
processed distributions at those positions are p_1..p_k, and p_{k+1} after the last. Position j
accepts x_j with probability min(1, p_j(x_j) / q_j(x_j)); at the first rejection the request
emits a token from the residual norm(max(0, p_j - q_j)) and stops; when all k are accepted it
emits a bonus token from p_{k+1}. The emitted token at each position then has distribution
p_j: accepted with mass min(p, q), residual mass max(0, p - q).

Greedy rows are point masses on both sides (the draft's argmax, the target's argmax), for which
the rule is acceptance on equality and the target's argmax otherwise: the tokens of plain greedy
decoding. All of it runs on padded [requests, k] tensors, no loop over requests or positions.
"""

from __future__ import annotations

import torch

from quire.sample.sampler import categorical


def rejection_sample(
    draft_token_ids: torch.Tensor,  # [B, K] int64, padded past each row's count
    num_draft_tokens: torch.Tensor,  # [B] int64, each <= K
    draft_probs: torch.Tensor,  # [B, K, V] q_j, rows sum to 1 (padding: anything)
    target_probs: torch.Tensor,  # [B, K, V] p_j, rows sum to 1 (padding: anything)
    bonus_token_ids: torch.Tensor,  # [B] int64, a sample of p_{k+1} for each row's k
    uniforms: torch.Tensor,  # [B, K] float32 in [0, 1): the acceptance tests' draws
    residual_noise_seeds: list[int | None],  # B * K keys (row-major) of the residual samples
) -> tuple[torch.Tensor, torch.Tensor]:
    """K >= 1. Returns the emitted tokens [B, K + 1] int64 (-1 past each row's count) and the count of
    emitted tokens per row [B] int64 (accepted proposals + 1)."""
    batch, max_k = draft_token_ids.shape
    index = draft_token_ids[:, :, None]
    p_x = target_probs.gather(-1, index)[:, :, 0]  # [B, K]
    q_x = draft_probs.gather(-1, index)[:, :, 0]
    valid = torch.arange(max_k, device=draft_token_ids.device) < num_draft_tokens[:, None]
    # u < p/q, written without the division (q(x) > 0: the draft drew x).
    accepted = (uniforms * q_x < p_x) & valid  # [B, K]
    num_accepted = accepted.long().cumprod(dim=-1).sum(dim=-1)  # leading accepted, [B]

    residual = (target_probs - draft_probs).clamp_min_(0.0).view(batch * max_k, -1)
    # Where p <= q everywhere (rounding; a rejection then has probability ~0) sample p itself.
    empty = residual.sum(dim=-1, keepdim=True) <= 0
    residual = torch.where(empty, target_probs.view(batch * max_k, -1), residual)
    recovered = categorical(residual, residual_noise_seeds).view(batch, max_k)

    positions = torch.arange(max_k + 1, device=draft_token_ids.device)
    padded = torch.nn.functional.pad(draft_token_ids, (0, 1), value=-1)  # [B, K + 1]
    # The token after the accepted run: the residual sample at the first rejection, or the bonus.
    at_rejection = recovered.gather(-1, num_accepted.clamp(max=max_k - 1)[:, None])[:, 0]
    last = torch.where(num_accepted < num_draft_tokens, at_rejection, bonus_token_ids)
    out = torch.where(positions < num_accepted[:, None], padded, -1)
    out = torch.where(positions == num_accepted[:, None], last[:, None], out)
    return out, num_accepted + 1
