"""GGUF files of the default model in the formats model hubs publish, made by llama.cpp's own quantizer.

1. A float32 GGUF written with gguf-py: the model's GGUF file (SmolLM2-135M-Instruct Q4_1, its tied table Q8_0)
   with every tensor decoded to float32 (gguf-py's `dequantize`) and the metadata copied, `general.file_type` 0
   (ALL_F32). So the float32 reference is the Q4_1 file's decoded weights (the same tensors as
   benchmarks/peer_model.py's export), not the original bf16 model, which does not ship here.
2. That file quantized by llama.cpp (`llama_model_quantize`, what `llama-quantize` runs, default parameters) to each
   `LLAMA_FTYPE_MOSTLY_*` type asked for, through the llama.cpp peer (benchmarks/peers/install_llama_cpp.sh).

Files go to `<cache dir>/peer-models/gguf/<model file>.<TYPE>.gguf` and are reused when present.

    PYTHONPATH=$PWD python benchmarks/kquant_files.py [--types Q4_K_M,Q5_K_M,Q6_K,Q8_0,Q4_0,Q5_0,Q5_1]
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

DEFAULT_TYPES = "Q4_K_M,Q5_K_M,Q6_K,Q8_0,Q4_0,Q5_0,Q5_1"


def write_float32_gguf(src: Path, dst: Path) -> None:
    """`src` with every tensor decoded to float32 (shapes, names, order and metadata kept)."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    tmp = dst.with_suffix(".tmp")
    writer = gguf.GGUFWriter(tmp, arch=arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name in ("general.architecture", "general.file_type"):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    for t in reader.tensors:
        # NOTE: GGUF lists dims fastest first; numpy wants them slowest first.
        values = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        writer.add_tensor(t.name, values.reshape([int(d) for d in reversed(t.shape)]))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(tmp, dst)


def kquant_files(types: list[str], model: str | None = None, llama_venv: str | None = None) -> dict[str, str]:
    """{type: path} for "F32" and each llama.cpp type, written on first use."""
    from engine_core.checkpoint.model_dir import gguf_file
    from engine_core.checkpoint.model_files import resolve_model_dir
    from engine_core.config import default_cache_dir

    cache = default_cache_dir()
    model_dir = resolve_model_dir(model, cache)
    src = gguf_file(model_dir)
    if src is None:
        raise ValueError(f"{model_dir} is not a GGUF model")
    out_dir = Path(cache) / "peer-models" / "gguf"
    out_dir.mkdir(parents=True, exist_ok=True)
    # NOTE: named after the source file and the new type (…Q4_1.Q4_K_M.gguf): each is a re-quantization of Q4_1.
    stem = Path(src).resolve().stem
    paths = {t: out_dir / f"{stem}.{t}.gguf" for t in ["F32", *types]}
    if not paths["F32"].is_file():
        write_float32_gguf(Path(src), paths["F32"])
    missing = [t for t in types if not paths[t].is_file()]
    if missing:
        from llama_cpp_client import LlamaCpp

        with LlamaCpp(llama_venv) as llama:
            for t in missing:
                tmp = paths[t].with_suffix(".tmp")
                seconds = llama.quantize(str(paths["F32"]), str(tmp), t)
                os.replace(tmp, paths[t])
                print(f"llama.cpp quantized {t} in {seconds:.1f} s: {paths[t]}", flush=True)
    return {t: str(p) for t, p in paths.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a .gguf file or its directory (default SmolLM2-135M-Instruct)")
    ap.add_argument("--types", default=DEFAULT_TYPES, help="llama.cpp LLAMA_FTYPE_MOSTLY_* suffixes")
    ap.add_argument("--llama-venv", default=None, help="the llama.cpp peer's venv (default: the install script's)")
    args = ap.parse_args()
    for t, path in kquant_files(args.types.split(","), args.model, args.llama_venv).items():
        print(f"{t}\t{os.path.getsize(path) / 1e6:.1f} MB\t{path}")


if __name__ == "__main__":
    main()
