"""A compressed-tensors int8 checkpoint's `quantization_config` (config.json), read and checked: no torch.

Accepted (what vLLM's CPU backend runs as W8A8 / W8A16 int8): `quant_method` "compressed-tensors", `format`
"int-quantized" or "naive-quantized", every config group targeting `Linear` with weights int8, symmetric, per
output channel (`strategy` "channel"), static; input activations absent (weight-only) or int8, symmetric, per token,
dynamic. The weights are then `<layer>.weight` (int8 `[out, in]`) and `<layer>.weight_scale` (float `[out, 1]`);
layers in `ignore` (typically `lm_head`) stay float. Everything else (per-group or per-tensor weights, zero points,
static activation scales, fp8, packed int4) is refused with the field that says so.
NOTE: both run as `quantization="int8"` does (weight-only below its raced row count, W8A8 from it): a W8A16
checkpoint's codes are the same per-channel codes, and its activations are quantized where int8 runs W8A8.
"""

from __future__ import annotations

from dataclasses import dataclass

QUANT_METHOD = "compressed-tensors"
_FORMATS = ("int-quantized", "naive-quantized")


@dataclass(frozen=True)
class CompressedTensorsInt8:
    """An accepted int8 scheme: whether activations are quantized (W8A8) and which layers stay float."""

    w8a8: bool
    ignore: tuple[str, ...]


def _args(group: dict, key: str, where: str) -> dict | None:
    value = group.get(key)
    if value is not None and not isinstance(value, dict):
        raise ValueError(f"{where}.{key} must be an object, got {type(value).__name__}")
    return value


def _check(args: dict, where: str, strategy: str, dynamic: bool) -> None:
    """Refuses `args` unless it is int8, symmetric, `strategy`, with `dynamic` as given."""
    expected = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": strategy, "dynamic": dynamic}
    for field, want in expected.items():
        got = args.get(field, False if field == "dynamic" else None)
        if got != want:
            raise ValueError(f"{where}.{field} = {got!r} is not supported: int8 needs {want!r}")
    if args.get("group_size") is not None:
        raise ValueError(f"{where}.group_size = {args['group_size']!r} is not supported: per-channel int8 only")


def parse_quantization_config(raw: dict[str, object]) -> CompressedTensorsInt8 | None:
    """The scheme of config.json `raw` if it is a compressed-tensors checkpoint (None: it is not quantized that way).

    Raises ValueError naming the field for a compressed-tensors scheme this engine cannot run."""
    qc = raw.get("quantization_config")
    if not isinstance(qc, dict) or qc.get("quant_method") != QUANT_METHOD:
        return None
    fmt = qc.get("format")
    if fmt not in _FORMATS:
        raise ValueError(f"quantization_config.format = {fmt!r} is not supported; supported: {', '.join(_FORMATS)}")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ValueError("quantization_config.config_groups is missing or empty")
    modes = set()
    for name, group in groups.items():
        where = f"quantization_config.config_groups.{name}"
        if not isinstance(group, dict):
            raise ValueError(f"{where} must be an object")
        if group.get("targets") != ["Linear"]:
            raise ValueError(f"{where}.targets = {group.get('targets')!r} is not supported: ['Linear'] only")
        weights = _args(group, "weights", where)
        if weights is None:
            raise ValueError(f"{where}.weights is missing")
        _check(weights, f"{where}.weights", "channel", dynamic=False)
        inputs = _args(group, "input_activations", where)
        if inputs is not None:
            _check(inputs, f"{where}.input_activations", "token", dynamic=True)
        if _args(group, "output_activations", where) is not None:
            raise ValueError(f"{where}.output_activations is not supported")
        modes.add(inputs is not None)
    if len(modes) > 1:
        raise ValueError("quantization_config.config_groups mix W8A8 and weight-only groups; one scheme only")
    ignore = qc.get("ignore") or []
    if not isinstance(ignore, list) or not all(isinstance(x, str) for x in ignore):
        raise ValueError("quantization_config.ignore must be a list of layer names")
    return CompressedTensorsInt8(w8a8=modes.pop(), ignore=tuple(ignore))
