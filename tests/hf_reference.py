"""transformers as the reference: greedy decoding with its own forward pass and KV cache, and its beam search."""

from __future__ import annotations

import torch

from engine_core.beam_search import BeamSearchParams


def hf_greedy(model: torch.nn.Module, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """Argmax decoding for `max_tokens` steps, never stopping at EOS (matches `ignore_eos=True`)."""
    ids = torch.tensor([prompt_ids])
    out: list[int] = []
    past = None
    with torch.no_grad():
        for _ in range(max_tokens):
            res = model(input_ids=ids, past_key_values=past, use_cache=True)
            past = res.past_key_values
            nxt = int(res.logits[0, -1].argmax())
            out.append(nxt)
            ids = torch.tensor([[nxt]])
    return out


def hf_beams(
    model: torch.nn.Module, ids: list[int], params: BeamSearchParams, eos: list[int] | None
) -> list[list[int]]:
    """transformers' `generate(num_beams=...)` returned hypotheses (generated tokens, each cut after its first stop
    token), the reference `LLM.beam_search` must equal."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            num_beams=params.beam_width,
            num_return_sequences=params.num_returned,
            do_sample=False,
            max_new_tokens=params.max_tokens,
            length_penalty=params.length_penalty,
            early_stopping=params.early_stopping,
            eos_token_id=eos,
            pad_token_id=eos[0] if eos else 0,
            # NOTE: the checkpoint's generation config may set sampling knobs; beam search here uses none of them.
            temperature=None,
            top_p=None,
            top_k=None,
            repetition_penalty=None,
        )
    beams = []
    for row in out[:, len(ids) :].tolist():
        # NOTE: a hypothesis ends at its first stop token (no running beam continues past one); the rest is padding.
        ends = [i for i, t in enumerate(row) if t in (eos or [])]
        beams.append(row[: ends[0] + 1] if ends else row)
    return beams
