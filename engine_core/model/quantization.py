"""Which weight format a load runs (`quantization` against the checkpoint and the CPU), decided before the weights
load, so that every refusal names its flag or field before the expensive work."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import structlog
import torch

from engine_core.checkpoint.compressed_tensors import CompressedTensorsInt8, parse_quantization_config
from engine_core.checkpoint.model_config import read_config_json
from engine_core.model.compressed_tensors_weights import iter_int8_checkpoint
from engine_core.model.layers.cpu_bfloat16 import this_cpu_flags
from engine_core.model.layers.cpu_int8 import int8_unsupported
from engine_core.model.layers.gguf_a8 import gguf_a8_unsupported

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class WeightFormat:
    """`int8`: the linears run int8 (cpu_int8.py); `checkpoint`: the checkpoint's own int8 scheme, if it has one;
    `a8`: 4-bit GGUF codes run with 8-bit activations (gguf_a8.py)."""

    int8: bool
    checkpoint: CompressedTensorsInt8 | None
    a8: bool = False

    def weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's tensors as the model's loader takes them (int8 weights and scales merged to float32)."""
        return iter_int8_checkpoint(tensors) if self.checkpoint is not None else iter(tensors)


def resolve_weight_format(
    quantization: str | None, model_dir: str, device: torch.device, cpu_flags: Iterable[str] | None = None
) -> WeightFormat:
    """Raises ValueError naming `quantization` or the checkpoint's field for a combination this engine cannot run."""
    checkpoint = parse_quantization_config(read_config_json(model_dir))
    if quantization == "compressed-tensors" and checkpoint is None:
        raise ValueError(
            f"quantization='compressed-tensors' needs a checkpoint whose config.json has quantization_config with "
            f"quant_method 'compressed-tensors'; {model_dir} has none"
        )
    if checkpoint is not None and quantization not in (None, "int8", "compressed-tensors"):
        raise ValueError(f"quantization={quantization!r} does not match the checkpoint's compressed-tensors int8")
    int8 = checkpoint is not None or quantization == "int8"
    if int8 and device.type not in ("cpu", "cuda"):
        raise ValueError(f"quantization={quantization or 'compressed-tensors'!r} runs on CPU or CUDA, not {device}")
    if int8 and device.type == "cpu":  # CUDA: weight-only int8 through Triton (layers/cuda_codes.py)
        # NOTE: refused rather than run on a CPU with neither int8 dot products nor AVX2: oneDNN emulates the dot
        # products slower than float32 and the coded kernel is portable code there, and a user who asked for int8
        # asked for speed at a known quality cost.
        reason = int8_unsupported(this_cpu_flags() if cpu_flags is None else cpu_flags)
        if reason is not None:
            raise ValueError(reason)
    if quantization == "gguf_a8":
        reason = gguf_a8_unsupported(device, this_cpu_flags() if cpu_flags is None else cpu_flags)
        if reason is not None:
            raise ValueError(reason)
        return WeightFormat(int8=False, checkpoint=None, a8=True)
    if checkpoint is not None:
        log.info("compressed-tensors int8 checkpoint", w8a8=checkpoint.w8a8, ignore=list(checkpoint.ignore))
    return WeightFormat(int8=int8, checkpoint=checkpoint)
