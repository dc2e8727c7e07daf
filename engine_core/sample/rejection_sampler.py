"""Rejection sampling of drafts that come with a distribution (a draft model's), as in vLLM's `RejectionSampler`.

Leviathan et al. (2023): draft token d, proposed with probability q(d), is accepted with probability
min(1, p(d) / q(d)), where p is the target's distribution at that position; the first rejected position emits a token
drawn from the normalised residual max(0, p - q) instead. The emitted tokens then follow p exactly, whatever q is.

p and q are the *sampled* distributions: the row's temperature, min_p, top_k and top_p applied to the logits
(`sampled_probs`, the same stages in the same order as `Sampler.sample`), so the draft proposes from what the target
would sample from. Rows here are random rows only: greedy rows accept the longest argmax-equal prefix
(worker/spec_verify.py), and rows with logits processors never get drafts (spec_decode/drafter.py, can_speculate).

Seeded rows draw every uniform and residual sample from generators reseeded from (seed, output position), so a
seeded request repeats run to run; unseeded rows use the batch's shared generator.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine_core.sample.sampler import apply_min_p, apply_top_k, apply_top_p
from engine_core.sample.sampling_batch import step_seed
from engine_core.sampling_params import SamplingParams

# NOTE: distinct seed streams (xor-ed into the request's seed) for the draft's proposals and for the verification's
# draws, so neither repeats the noise the target's own sampler draws at the same output position.
PROPOSE_STREAM = 0x5EED_D8AF
VERIFY_STREAM = 0x5EED_7E81


def sampled_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """[rows, vocab] fp32 probabilities each row samples from: temperature, min_p, top_k, top_p (random rows)."""
    logits = logits.to(torch.float32, copy=True)
    device = logits.device
    temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device)
    logits = logits.div_(temperature.unsqueeze(1))
    if any(p.min_p > 0 for p in params):
        logits = apply_min_p(logits, torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device))
    top_k = [p.top_k for p in params]
    if any(top_k):
        max_k = min(max(top_k), logits.shape[-1])
        top_k_t = torch.tensor([min(k, max_k) for k in top_k], dtype=torch.int64, device=device)
        logits = apply_top_k(logits, top_k_t, max_k)
    if any(p.top_p < 1.0 for p in params):
        logits = apply_top_p(logits, torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device))
    return torch.softmax(logits, dim=-1)


def row_generator(generator: torch.Generator, seed: int | None, stream: int, position: int) -> torch.Generator | None:
    """`generator` reseeded for output `position` of a seeded row; None (use the shared one) for an unseeded row."""
    if seed is None:
        return None
    return generator.manual_seed(step_seed(seed ^ stream, position))


def draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token from a [vocab] distribution."""
    return int(torch.multinomial(probs, 1, generator=generator).item())


@dataclass
class RowDrafts:
    """One random row's drafts with the distributions they were drawn from."""

    tokens: list[int]  # d_1 .. d_k
    probs: torch.Tensor  # [k, vocab] q at each draft position
    seed: int | None  # the row's seed (None: the shared generator)
    first_position: int  # output position of d_1 (its number of outputs before this step)


def verify_row(
    p: torch.Tensor, drafts: RowDrafts, shared: torch.Generator, scratch: torch.Generator
) -> tuple[int, int | None]:
    """Leviathan's test on one row: `p` [k, vocab] are the target's sampled distributions at the draft positions.
    Returns (accepted drafts a, the token to emit at position a instead of the target's own sample, or None when
    every draft was accepted: the target's sample at position k is then the bonus token)."""
    k = len(drafts.tokens)
    index = torch.arange(k, device=p.device)
    d = torch.tensor(drafts.tokens, device=p.device)
    p_d, q_d = p[index, d], drafts.probs[index, d]
    uniforms = torch.empty(k, dtype=torch.float32, device=p.device)
    for i in range(k):
        gen = row_generator(scratch, drafts.seed, VERIFY_STREAM, drafts.first_position + i) or shared
        uniforms[i : i + 1].uniform_(generator=gen)
    # NOTE: u < p/q written as u * q < p: no division by a q of 0 (a draft drawn from q has q > 0 anyway).
    rejected = torch.nonzero(uniforms * q_d >= p_d).flatten()
    if not len(rejected):
        return k, None
    a = int(rejected[0].item())
    residual = (p[a] - drafts.probs[a]).clamp_min_(0.0)
    residual[drafts.tokens[a]] = 0.0  # NOTE: exact already (p(d) < q(d) rejected it), kept against rounding
    if float(residual.sum()) <= 0.0:
        residual = p[a].clone()  # NOTE: only by rounding (p == q); p itself is then the law to draw from
        residual[drafts.tokens[a]] = 0.0
    gen = row_generator(scratch, drafts.seed, VERIFY_STREAM ^ 1, drafts.first_position + a) or shared
    return a, draw(residual, gen)
