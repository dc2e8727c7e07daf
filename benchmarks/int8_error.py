"""Where int8's error comes from: the default model's float32 export in transformers with int8 simulated per layer
type (weights quantized per output channel as `quantize_per_channel` does, dequantized; activations rounded per
token to int8 as W8A8's dynamic scales do), scored against float32 on the first 1,024 tokens of quality.py's public
text (two windows of 512): top-1 agreement per position and perplexity.

    PYTHONPATH=$PWD python benchmarks/int8_error.py

The LM head and the embedding stay float32 in every row (the tied weight is untied first). The `smoothed` rows
are SmoothQuant's per-channel smoothing (s_j = max|x_j|^a / max|W_:,j|^(1 - a), x / s into the int8 activations,
W * s into the int8 weights, which folds into the RMSNorm weights and up_proj's rows in an engine) with the
activation maxima from tokens 1,024-2,047 of the same text, which the score does not see.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
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
LAST_ROW = "+ int8 activations everywhere (W8A8)"
SMOOTH_ALPHAS = (0.5, 0.75)
# projections that share an input share its smoothing (q/k/v: input_layernorm's output; gate/up: the post-attention
# norm's; down: SiLU x up, foldable into up_proj's rows)
SMOOTH_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("down_proj",))


def per_token_int8(t: torch.Tensor) -> torch.Tensor:
    s = t.abs().amax(-1, keepdim=True).clamp_min(1e-12) / 127
    return torch.round(t / s).clamp(-127, 127) * s


def int8_input(smooth: torch.Tensor | None) -> Callable[..., tuple[torch.Tensor]]:
    """A hook that rounds a linear's input per token to int8 (divided by `smooth` first, where given)."""
    return lambda _m, a: (per_token_int8(a[0] if smooth is None else a[0] / smooth),)


def main() -> None:
    from transformers import AutoModelForCausalLM

    from engine_core.checkpoint.model_files import resolve_model_dir
    from engine_core.config import default_cache_dir
    from engine_core.io.tokenizer import load_tokenizer
    from engine_core.model.layers.int8_gemm import quantize_per_channel

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoothed-only", action="store_true", help="only W8A8 everywhere and the smoothed rows")
    args = ap.parse_args()
    torch.set_num_threads(2)
    cache = default_cache_dir()
    model_dir = resolve_model_dir(None, cache)
    ids = load_tokenizer(model_dir, cache).encode(public_text()[0])[:1024]
    x = torch.tensor([ids[:512], ids[512:1024]])
    ids_calib = load_tokenizer(model_dir, cache).encode(public_text()[0])[1024:2048]
    model = AutoModelForCausalLM.from_pretrained(peer_model_dir(model_dir, cache), dtype=torch.float32).eval()
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())  # the embedding stays float
    with torch.no_grad():
        ref = model(x).logits.log_softmax(-1)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and "lm_head" not in n}
    floats = {n: m.weight.detach().clone() for n, m in linears.items()}
    x_max = {n: torch.zeros(m.in_features) for n, m in linears.items()}

    def record(name: str) -> Callable[..., None]:
        def hook(_m: torch.nn.Module, a: tuple[torch.Tensor, ...]) -> None:
            x_max[name] = torch.maximum(x_max[name], a[0].abs().amax((0, 1)))

        return hook

    calib = [m.register_forward_pre_hook(record(n)) for n, m in linears.items()]
    with torch.no_grad():
        model(torch.tensor([ids_calib]))
    for h in calib:
        h.remove()

    def smoothing(alpha: float) -> dict[str, torch.Tensor]:
        """Each projection's s (shared by the projections of one input)."""
        out: dict[str, torch.Tensor] = {}
        for layer in {n.rsplit(".", 2)[0] for n in linears}:
            for group in SMOOTH_GROUPS:
                names = [n for n in linears if n.startswith(layer + ".") and n.rsplit(".", 1)[1] in group]
                w_max = torch.stack([floats[n].abs().amax(0) for n in names]).amax(0)
                s = (x_max[names[0]].clamp_min(1e-5) ** alpha / w_max.clamp_min(1e-5) ** (1 - alpha)).clamp_min(1e-5)
                out |= dict.fromkeys(names, s)
        return out

    def quantize_weights(smooth: dict[str, torch.Tensor]) -> None:
        for n, m in linears.items():
            w = floats[n] * smooth[n] if n in smooth else floats[n]
            codes, scale = quantize_per_channel(w)
            m.weight.data = codes.float() * scale[:, None]

    def score(a8_types: Sequence[str], smooth: dict[str, torch.Tensor] | None = None) -> tuple[float, float]:
        # NOTE: a projection whose input stays float keeps its weight unsmoothed (nothing divides its x by s)
        smooth = {n: s for n, s in (smooth or {}).items() if any(t in n for t in a8_types)}
        quantize_weights(smooth)
        hooks = [
            m.register_forward_pre_hook(int8_input(smooth.get(n)))
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
    for name, types in ROWS.items() if not args.smoothed_only else [(LAST_ROW, ROWS[LAST_ROW])]:
        agree, ppl = score(types)
        print(f"| {name} | {agree * 100:.2f} % | {ppl:.3f} | {(ppl / ref_ppl - 1) * 100:+.2f} % |", flush=True)
    for alpha in SMOOTH_ALPHAS:
        smooth = smoothing(alpha)
        for name, types in (("W8A8 everywhere", LAYER_TYPES), ("W8A8 but down float", LAYER_TYPES[:-1])):
            agree, ppl = score(types, smooth)
            delta = (ppl / ref_ppl - 1) * 100
            print(f"| {name}, smoothed (a = {alpha}) | {agree * 100:.2f} % | {ppl:.3f} | {delta:+.2f} % |", flush=True)


if __name__ == "__main__":
    main()
