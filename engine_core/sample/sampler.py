"""The sampler: turns one step's logits into tokens (and logprobs), vectorised over rows with per-row parameters.

Stage order follows vLLM V1: logprobs of the raw logits -> fp32 -> the logits processors (allowed_token_ids,
bad_words, min_tokens, logit_bias, penalties: logits_processor.py) -> greedy argmax -> temperature -> min-p ->
top-k/top-p -> random sampling by an exponential race. A stage runs only when some row needs it (its metadata field
is not None, the processor is bound).

A row that cannot be sampled (its logits NaN or +inf, or every token masked) gets token -1 instead of an arbitrary
token: the runner fails that request alone (docs/reliability.md). Greedy rows are checked by their row maximum, which
the greedy pick computes anyway; random rows by the race's winning value: no extra pass over the vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine_core.plan import LogprobsTensors
from engine_core.sample.sampling_batch import SamplingMetadata

# Candidates searched for the top-p nucleus before falling back to the whole vocabulary (see apply_top_p).
TOP_P_CANDIDATES = 256


# The token of a row that could not be sampled.
FAILED_TOKEN = -1


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [rows] int64; FAILED_TOKEN where the row could not be sampled
    logprobs: LogprobsTensors | None  # of the raw logits, k = the largest `logprobs` asked; None when none asked


def gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, k: int) -> LogprobsTensors:
    """Picks, from full [rows, vocab] logprobs, each row's `token_ids` entry, its rank and the top-k alternatives."""
    token_ids = token_ids.to(torch.int64)
    chosen = logprobs.gather(-1, token_ids.unsqueeze(-1))  # [rows, 1]
    # NOTE: rank = 1 + the number of strictly more likely tokens, so a tie with the best token is rank 1.
    ranks = (logprobs > chosen).sum(-1) + 1
    if k > 0:
        top_logprobs, top_ids = logprobs.topk(k, dim=-1)
        ids = torch.cat([token_ids.unsqueeze(-1), top_ids], dim=-1)
        values = torch.cat([chosen, top_logprobs], dim=-1)
    else:
        ids, values = token_ids.unsqueeze(-1), chosen
    return LogprobsTensors(token_ids=ids, logprobs=values, ranks=ranks)


def compute_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, k: int) -> LogprobsTensors:
    """Logprobs (log_softmax in fp32 of the raw `logits`) of `token_ids` [rows] plus each row's top-k."""
    return gather_logprobs(torch.log_softmax(logits.to(torch.float32), dim=-1), token_ids, k)


# ---- stages (each takes and returns fp32 logits [rows, vocab]; may modify them in place) ----------------------------
def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drops tokens less likely than min_p times the most likely token (after temperature)."""
    probs = torch.softmax(logits, dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill_(probs < threshold, float("-inf"))


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> torch.Tensor:
    """top-k without a full sort: one topk(max_k), then each row's k-th value as its threshold (ties are kept)."""
    top_values = logits.topk(max_top_k, dim=-1).values  # [rows, max_k] descending
    disabled = top_k == 0
    kth = top_values.gather(1, (top_k.clamp(min=1) - 1).unsqueeze(1))
    kth = kth.masked_fill_(disabled.unsqueeze(1), float("-inf"))
    return logits.masked_fill_(logits < kth, float("-inf"))


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keeps the smallest set of most likely tokens whose mass reaches p (the token crossing p included).

    NOTE: the nucleus is found among the top `TOP_P_CANDIDATES` tokens (a partial top-k instead of a full sort of
    the vocabulary, which costs ~20x more on CPU); only when some row's nucleus is wider than that is the search
    redone over the whole vocabulary. Tokens tied with the last one kept are kept too.
    """
    vocab = logits.shape[-1]
    enabled = (top_p < 1.0).unsqueeze(1)
    log_total = torch.logsumexp(logits, dim=-1, keepdim=True)
    for k in (min(TOP_P_CANDIDATES, vocab), vocab):
        values = logits.topk(k, dim=-1).values  # [rows, k] descending
        probs = torch.exp(values - log_total)
        keep = (probs.cumsum(dim=-1) - probs) < top_p.unsqueeze(1)  # mass strictly before the token is below p
        # NOTE: deciding on the fallback reads one bool back from the device, a sync only top-p batches pay.
        if k == vocab or not bool((keep[:, -1:] & enabled).any()):
            break
    # NOTE: at least the first candidate: a NaN row keeps nothing, and index -1 would fail the whole step.
    threshold = values.gather(1, (keep.sum(dim=-1, keepdim=True) - 1).clamp_min_(0))
    threshold = threshold.masked_fill_(~enabled, float("-inf"))
    return logits.masked_fill_(logits < threshold, float("-inf"))


def random_sample(probs: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """argmax(probs / E) with E ~ Exp(1) i.i.d. draws a token with probability probs (the exponential race).
    `probs` is divided by E in place."""
    # NOTE: E = -log(U) from uniform draws rather than exponential_(), which is ~3x slower on CPU. E is clamped
    # above 0 so that probs / E is never 0/0 = NaN, which argmax would pick (a masked token could win).
    noise = torch.empty_like(probs)
    if len(meta.generators) < meta.num_rows:
        noise.uniform_(generator=meta.shared_generator)
    # NOTE: one draw per seeded row with its own generator, so its noise never depends on its batch mates.
    for row, seeded in meta.generators.items():
        noise[row].uniform_(generator=seeded.next_generator())
    noise.log_().neg_().clamp_min_(torch.finfo(noise.dtype).tiny)
    return probs.div_(noise).argmax(dim=-1)


def row_argmax(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's maximum and its first maximal index, as `logits.max(dim=-1)`: a row with a NaN has a NaN maximum
    (`fail_unsampleable` fails it; its index is unused)."""
    if logits.device.type != "cpu" or logits.dtype != torch.float32 or logits.requires_grad:
        return logits.max(dim=-1)
    # NOTE: numpy's argmax is vectorised, torch's CPU max(dim) is not: this whole function takes 10.5-16.6 against
    # 48.5 us of CPU time for one row of 49,152 logits (1 thread; numpy's argmax alone ~3 us, the rest the tensors'
    # wrapping and the gather), 24 against 212 us for four, a per-token cost at batch 1. numpy also returns the
    # first maximal index, and the first NaN where there is one, whose value then reads NaN.
    host = logits.numpy()  # NOTE: numpy reads the strides, so a view needs no copy
    index = torch.from_numpy(host.argmax(axis=-1))
    return logits.gather(-1, index.unsqueeze(-1)).squeeze(-1), index


def fail_unsampleable(tokens: torch.Tensor, row_max: torch.Tensor) -> torch.Tensor:
    """FAILED_TOKEN where a row's maximum logit is not finite: NaN somewhere, +inf, or every token masked (-inf)."""
    # NOTE: two small [rows] ops and no device sync; the host learns of a failed row with the tokens.
    return torch.where(torch.isfinite(row_max), tokens, FAILED_TOKEN)


class Sampler:
    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        return self.forward(logits, meta)

    def forward(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        raw_logprobs = None
        if meta.max_num_logprobs is not None:
            raw_logprobs = torch.log_softmax(logits.to(torch.float32), dim=-1)
        sampled = self.sample(logits, meta)
        logprobs = None
        if raw_logprobs is not None:
            # NOTE: a failed row's logprobs are of token 0; the row's request fails, so nobody reads them.
            logprobs = gather_logprobs(raw_logprobs, sampled.clamp_min(0), meta.max_num_logprobs or 0)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs)

    def sample(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        # NOTE: an all-greedy step skips the processors that cannot change an argmax.
        processors = meta.argmax_processors if meta.all_greedy else meta.processors
        if meta.all_greedy and not processors:
            row_max, greedy = row_argmax(logits)
            return fail_unsampleable(greedy, row_max)
        # NOTE: a private fp32 copy: the stages work in place and the caller's logits must stay untouched.
        logits = logits.to(torch.float32, copy=True)
        for processor in processors:
            logits = processor.apply(logits)
        row_max = greedy = None
        if not meta.all_random:
            row_max, greedy = row_argmax(logits)
        if meta.all_greedy:
            assert row_max is not None and greedy is not None
            return fail_unsampleable(greedy, row_max)
        assert meta.temperature is not None
        logits = logits.div_(meta.temperature.unsqueeze(1))
        if meta.min_p is not None:
            logits = apply_min_p(logits, meta.min_p)
        if meta.top_k is not None:
            logits = apply_top_k(logits, meta.top_k, meta.max_top_k)
        if meta.top_p is not None:
            logits = apply_top_p(logits, meta.top_p)
        raced = torch.softmax(logits, dim=-1)
        tokens = random_sample(raced, meta)  # `raced` now holds probs / E
        # NOTE: a random row failed when its winner's probs / E is not > 0: NaN (NaN or +inf logits, every token
        # masked) or 0. A [rows] gather, where a row maximum would cost an all-random step a pass over the vocabulary.
        sampled = raced.gather(1, tokens.unsqueeze(1)).squeeze(1) > 0
        if greedy is None:
            return torch.where(sampled, tokens, FAILED_TOKEN)
        assert meta.is_greedy is not None and row_max is not None
        tokens = torch.where(meta.is_greedy, greedy, tokens)
        return torch.where(torch.isfinite(row_max) & (meta.is_greedy | sampled), tokens, FAILED_TOKEN)
