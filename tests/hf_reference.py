"""transformers as the reference: greedy decoding with its own forward pass and KV cache."""

from __future__ import annotations

import torch


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
