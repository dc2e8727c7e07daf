"""A compressed-tensors int8 checkpoint's tensors as float32 weights for the model's loader.

Each int8 `<layer>.weight` is paired with its `<layer>.weight_scale` (float, `[out, 1]` or `[out]`) and yielded as
`codes * scale` in float32; the int8 method (model/layers/cpu_int8.py) then quantizes it per output channel again.
NOTE: that round trip gives back the checkpoint's codes and scales wherever a row's largest code is +-127, which is
what symmetric per-channel quantization writes (scale = absmax / 127); the float product of an int8 code and a
float32 scale is within 2^-24 relative of exact, far from the 0.5 a rounding back would need to move a code. A
fused projection (Q/K/V, gate/up) is then quantized per output row of its shards, as in the checkpoint.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

# tensors of schemes the config check refuses (zero points, static activation scales); refused here too by name
_REFUSED_SUFFIXES = (".weight_zero_point", ".input_scale", ".input_zero_point", ".weight_g_idx", ".weight_packed")


def _dequantize(name: str, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    if codes.dim() != 2:
        raise ValueError(f"{name}: an int8 weight must be 2-D, got shape {list(codes.shape)}")
    if scale.numel() != codes.shape[0] or not scale.is_floating_point():
        raise ValueError(
            f"{name}_scale: expected a float scale per output channel ({codes.shape[0]}), got "
            f"{scale.dtype} of shape {list(scale.shape)}"
        )
    return codes.float() * scale.float().reshape(-1, 1)


def iter_int8_checkpoint(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """`weights` with every int8 weight and its scale merged into one float32 weight; other tensors pass through.

    Raises ValueError naming the tensor for a weight without its scale, a scale without its weight, or a tensor of
    a refused scheme."""
    codes: dict[str, torch.Tensor] = {}
    scales: dict[str, torch.Tensor] = {}
    for name, tensor in weights:
        if name.endswith(_REFUSED_SUFFIXES):
            raise ValueError(f"tensor {name!r} is not supported: symmetric per-channel int8 weights only")
        if name.endswith(".weight_scale"):
            weight_name = name.removesuffix("_scale")
            if weight_name in codes:
                yield weight_name, _dequantize(weight_name, codes.pop(weight_name), tensor)
            else:
                scales[weight_name] = tensor
        elif name.endswith(".weight") and tensor.dtype == torch.int8:
            if name in scales:
                yield name, _dequantize(name, tensor, scales.pop(name))
            else:
                codes[name] = tensor
        else:
            yield name, tensor
    if codes:
        raise ValueError(f"int8 weight {sorted(codes)[0]!r} has no weight_scale in the checkpoint")
    if scales:
        raise ValueError(f"{sorted(scales)[0]}_scale has no int8 weight in the checkpoint")
