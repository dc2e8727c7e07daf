"""Where int8's error comes from: the default model's float32 export in transformers with int8 simulated per layer
type (weights quantized per output channel as `quantize_per_channel` does, dequantized; activations rounded per
token to int8 as W8A8's dynamic scales do), scored against float32 on the first 1,024 tokens of quality.py's public
text (two windows of 512): top-1 agreement per position and perplexity.

    PYTHONPATH=$PWD python benchmarks/int8_error.py

The LM head and the embedding stay float32 in every row (the tied weight is untied first).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from peer_model import peer_model_dir
from quality import public_text

LAYER_TYPES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ROWS = {
    "weights int8, activations float": (),
    "+ int8 activations into q/k/v": ("q_proj", "k_proj", "v_proj"),
    "+ int8 activations into o": ("o_proj",),
    "+ int8 activations into gate/up": ("gate_proj", "up_proj"),
    "+ int8 activations into down": ("down_proj",),
    "+ int8 activations everywhere (W8A8)": LAYER_TYPES,
}


def per_token_int8(t: torch.Tensor) -> torch.Tensor:
    s = t.abs().amax(-1, keepdim=True).clamp_min(1e-12) / 127
    return torch.round(t / s).clamp(-127, 127) * s


def main() -> None:
    from transformers import AutoModelForCausalLM

    from engine_core.checkpoint.model_files import resolve_model_dir
    from engine_core.config import default_cache_dir
    from engine_core.io.tokenizer import load_tokenizer
    from engine_core.model.layers.int8_gemm import quantize_per_channel

    torch.set_num_threads(2)
    cache = default_cache_dir()
    model_dir = resolve_model_dir(None, cache)
    ids = load_tokenizer(model_dir, cache).encode(public_text()[0])[:1024]
    x = torch.tensor([ids[:512], ids[512:1024]])
    model = AutoModelForCausalLM.from_pretrained(peer_model_dir(model_dir, cache), dtype=torch.float32).eval()
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())  # the embedding stays float
    with torch.no_grad():
        ref = model(x).logits.log_softmax(-1)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and "lm_head" not in n}
    for m in linears.values():
        codes, scale = quantize_per_channel(m.weight.detach())
        m.weight.data = codes.float() * scale[:, None]

    def score(a8_types: Sequence[str]) -> tuple[float, float]:
        hooks = [
            m.register_forward_pre_hook(lambda _m, a: (per_token_int8(a[0]),))
            for n, m in linears.items()
            if any(t in n for t in a8_types)
        ]
        with torch.no_grad():
            out = model(x).logits.log_softmax(-1)
        for h in hooks:
            h.remove()
        agree = (out.argmax(-1) == ref.argmax(-1)).float().mean().item()
        nll = -out[:, :-1].gather(-1, x[:, 1:, None]).mean().item()
        return agree, float(torch.tensor(nll).exp())

    ref_ppl = float((-ref[:, :-1].gather(-1, x[:, 1:, None]).mean()).exp())
    print(f"float32 perplexity {ref_ppl:.3f}")
    print("| int8 where | top-1 agreement | perplexity | vs float32 |")
    print("| --- | ---: | ---: | ---: |")
    for name, types in ROWS.items():
        agree, ppl = score(types)
        print(f"| {name} | {agree * 100:.2f} % | {ppl:.3f} | {(ppl / ref_ppl - 1) * 100:+.2f} % |", flush=True)


if __name__ == "__main__":
    main()
