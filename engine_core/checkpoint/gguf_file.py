"""Reads a GGUF file's header: its architecture and where each tensor's bytes are. No torch (the frontend imports it).

NOTE: gguf-py's `GGUFReader` builds a numpy view per element of every metadata array; for SmolLM2 (98,000 tokenizer
strings and merges) that took 7.7 s here, longer than the whole model load. The loader needs the tensor index and
one string, so this walks the header with `struct` and skips the rest (~0.03 s). The format is llama.cpp's
docs/gguf.md (versions 2 and 3, little-endian); types and block sizes come from gguf-py's constants.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

# GGUF architectures the engine loads, and whether llama.cpp stored their Q/K rows permuted (Mistral is "llama").
ARCHITECTURES = {"llama": True, "qwen2": False}
MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
# Bytes of each fixed-size metadata value type (docs/gguf.md: gguf_metadata_value_type); 8 is a string, 9 an array.
_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY, _UINT32 = 8, 9, 4
# Counts in the header are bounded: a corrupt count must fail at once, not loop for hours.
MAX_HEADER_ITEMS = 1 << 24


@dataclass(frozen=True)
class GgufTensor:
    """One tensor of the file: its shape as torch sees it (the last dimension is GGUF's ne[0], the contiguous one)."""

    name: str
    shape: tuple[int, ...]
    kind: GGMLQuantizationType
    offset: int  # from the start of the file
    nbytes: int


@dataclass(frozen=True)
class GgufIndex:
    path: Path
    size: int  # bytes of the whole file
    architecture: str
    tensors: list[GgufTensor]


class _Cursor:
    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def unpack(self, fmt: str) -> tuple[int, ...]:
        values = struct.unpack_from(fmt, self.data, self.pos)
        self.pos += struct.calcsize(fmt)
        return values

    def u32(self) -> int:
        return self.unpack("<I")[0]

    def u64(self) -> int:
        return self.unpack("<Q")[0]

    def string(self) -> str:
        n = self.u64()
        end = self.pos + n
        if end > len(self.data):
            raise EOFError
        text = self.data[self.pos : end].decode("utf-8", errors="replace")
        self.pos = end
        return text

    def skip_value(self, kind: int) -> None:
        if kind in _SCALAR_SIZES:
            self.pos += _SCALAR_SIZES[kind]
        elif kind == _STRING:
            n = self.u64()  # NOTE: not `self.pos += self.u64()`: that adds to the position read before the length
            self.pos += n
        elif kind == _ARRAY:
            item, count = self.u32(), self.u64()
            if count > MAX_HEADER_ITEMS:
                raise ValueError(f"metadata array of {count} items")
            if item in _SCALAR_SIZES:
                self.pos += _SCALAR_SIZES[item] * count
            else:
                for _ in range(count):
                    self.skip_value(item)
        else:
            raise ValueError(f"unknown metadata value type {kind}")
        if self.pos > len(self.data):
            raise EOFError


def check_architecture(index: GgufIndex) -> None:
    if index.architecture not in ARCHITECTURES:
        raise ValueError(
            f"{index.path}: GGUF architecture {index.architecture!r} is not supported; "
            f"supported: {', '.join(sorted(ARCHITECTURES))}"
        )


def read_index(path: str | Path, max_header_bytes: int = 256 << 20) -> GgufIndex:
    """The file's architecture and tensor index; raises ValueError when it is not a GGUF file this reader knows."""
    path = Path(path)
    size = path.stat().st_size
    length = min(size, 4 << 20)  # SmolLM2's header (tokenizer included) is 1.8 MB
    with path.open("rb") as f:
        while True:
            f.seek(0)
            head = f.read(length)
            try:
                return _parse(path, head, size)
            except EOFError:
                if length >= min(size, max_header_bytes):
                    raise ValueError(f"{path}: truncated GGUF header (or one over {max_header_bytes} bytes)") from None
                length = min(size, max_header_bytes, length * 4)


def _parse(path: Path, head: bytes, size: int) -> GgufIndex:
    c = _Cursor(head)
    try:
        if c.unpack("<4s")[0] != MAGIC:
            raise ValueError(f"{path} is not a GGUF file")
        version = c.u32()
        if version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {version} is not supported (2 or 3, little-endian)")
        num_tensors, num_kv = c.u64(), c.u64()
        if num_tensors > MAX_HEADER_ITEMS or num_kv > MAX_HEADER_ITEMS:
            raise ValueError(f"{path}: implausible header ({num_tensors} tensors, {num_kv} metadata keys)")
        architecture, alignment = "", DEFAULT_ALIGNMENT
        for _ in range(num_kv):
            key, kind = c.string(), c.u32()
            if key == "general.architecture" and kind == _STRING:
                architecture = c.string()
            elif key == "general.alignment" and kind == _UINT32:
                alignment = c.u32()
            else:
                c.skip_value(kind)
        infos = []
        for _ in range(num_tensors):
            name, ndim = c.string(), c.u32()
            if ndim > 4:
                raise ValueError(f"{path}: tensor {name!r} has {ndim} dimensions")
            dims = c.unpack(f"<{ndim}Q")
            kind, offset = c.u32(), c.u64()
            infos.append((name, dims, kind, offset))
    except struct.error:
        raise EOFError from None
    except RecursionError:
        raise ValueError(f"{path}: metadata arrays nested too deeply") from None
    if alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"{path}: general.alignment {alignment} is not a power of two")
    data_start = -(-c.pos // alignment) * alignment
    tensors = [_tensor(path, data_start, alignment, size, *info) for info in infos]
    return GgufIndex(path=path, size=size, architecture=architecture, tensors=tensors)


def _tensor(
    path: Path, data_start: int, alignment: int, size: int, name: str, dims: tuple[int, ...], kind: int, offset: int
) -> GgufTensor:
    try:
        qtype = GGMLQuantizationType(kind)
    except ValueError:
        raise ValueError(f"{path}: tensor {name!r} has unknown type {kind}") from None
    block, block_bytes = GGML_QUANT_SIZES[qtype]
    if not dims or dims[0] % block:
        raise ValueError(f"{path}: tensor {name!r} of shape {dims} does not split into {qtype.name} blocks")
    count = 1
    for d in dims:
        count *= d
    nbytes = count // block * block_bytes
    start = data_start + offset
    if offset % alignment:  # the format requires it, and a float32 view of the bytes needs it
        raise ValueError(f"{path}: tensor {name!r} is not aligned to {alignment} bytes")
    if start + nbytes > size:
        raise ValueError(f"{path}: tensor {name!r} runs past the end of the file")
    return GgufTensor(name=name, shape=tuple(reversed(dims)), kind=qtype, offset=start, nbytes=nbytes)
