"""`make gpu-check`'s `quantized` section: the CUDA linears on int8 codes (engine_core/model/layers/cuda_codes.py,
kernels/triton/coded_matmul.py), in three sub-checks, each recorded on its own (one that fails leaves the others'
numbers, and the partial report is written after each):

- `kernel`: `coded_matmul` against `ref_coded_matmul` at SmolLM2-135M's and Llama-3-8B's linear shapes (K, N), M in
  (1, 4, 16, 64, 512), int8 per channel and Q4_1-like codes (groups of 32 with offsets; one a byte, and packed two
  a byte as the CUDA linears keep 4-bit formats), bf16 activations: max error
  relative to the output's magnitude, ms per call beside `F.linear` on the bf16 weight, and at M = 1 the GB/s of
  weight bytes read against the HBM peak;
- `gguf_greedy`: the generated random SmolLM2-shaped model written as a GGUF file (matrices in Q8_0 / Q4_0 / Q4_1 /
  Q5_0 / Q5_1 by turns, gguf-py's own quantization); float32 greedy tokens of the CUDA codes path (CUDA graphs) ==
  transformers' float32 decoding of the same file (asserted, after recording both);
- `int8`: `quantization="int8"` on the random model: per-position top-1 agreement with float32 over the prompts
  (bf16 activations; bf16 float weights beside it), and batch-1 decode ms/token of int8, bf16 and the GGUF file
  (bf16 activations), CUDA graphs on (offline_throughput.py's `pagoda_batch1`).
"""

from __future__ import annotations

import importlib
import shutil
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from gpu_features import free_gpu_memory

if TYPE_CHECKING:
    from gpu_check import Check

SECTION = "quantized"
# (K, N) of each linear: SmolLM2-135M (qkv, o, gate_up, down, LM head) and Llama-3-8B (qkv, o, gate_up, down)
LINEAR_SHAPES = {
    "smollm2": [(576, 960), (576, 576), (576, 3072), (1536, 576), (576, 49152)],
    "llama8b": [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)],
}
ROWS = (1, 4, 16, 64, 512)
TINY_LINEAR_SHAPES = {"smollm2": [(64, 48)], "llama8b": [(128, 40)]}  # packed: K / 2 a multiple of 32
TINY_ROWS = (1, 17)
# matrices of the GGUF file in these formats by turns (the 1-D norms stay F32, as llama.cpp writes them)
GGUF_KINDS = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")


def _ms(fn: Callable[[], object]) -> float:
    """Median ms per call (`do_bench`, L2 flushed between calls); one timed call on CPU (the dry run's wiring)."""
    if not torch.cuda.is_available():
        fn()
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1000
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=10, rep=40))


def run(c: Check) -> dict[str, object]:
    """The section: each sub-check's result or its error; `failed_checks` lists the ones that raised."""
    result: dict[str, object] = {"failed_checks": []}
    checks = {"kernel": check_kernel, "gguf_greedy": check_gguf_greedy, "int8": check_int8}
    for name, fn in checks.items():
        t0 = time.monotonic()
        try:
            result[name] = fn(c)
            if result[name].get("errors"):  # type: ignore[attr-defined]
                result["failed_checks"].append(name)  # type: ignore[attr-defined]
        except Exception as e:  # recorded; the next sub-check still runs
            result[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-2500:]}
            result["failed_checks"].append(name)  # type: ignore[attr-defined]
        result[f"{name}_seconds"] = round(time.monotonic() - t0, 1)
        free_gpu_memory()
        c.results[SECTION] = {"status": "running", **result}
        c.write()
        failed = name in result["failed_checks"]  # type: ignore[operator]
        print(f"   {SECTION}.{name}: {'fail' if failed else 'ok'}", flush=True)
    return result


# ---- kernel ----------------------------------------------------------------------------------------------------------
def check_kernel(c: Check) -> dict[str, object]:
    from kernels.reference import ref_coded_matmul
    from kernels.triton import coded_matmul
    from kernels.triton.coded_matmul import pack_nibbles

    bench = importlib.import_module("kernels_bench")
    name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu (dry run)"
    peak = bench.hbm_peak_gbs(name)
    shapes, rows = (TINY_LINEAR_SHAPES, TINY_ROWS) if c.dry_run else (LINEAR_SHAPES, ROWS)
    dtype = torch.float32 if c.dry_run else torch.bfloat16  # NOTE: the interpreter's dots are fp32
    gen = torch.Generator(device=c.device).manual_seed(0)
    out: dict[str, object] = {"device": name, "hbm_peak_gbs": peak, "dtype": str(dtype).removeprefix("torch.")}
    worst = 0.0
    for model, pairs in shapes.items():
        cases = []
        for k, n in pairs:
            w = torch.randn(n, k, device=c.device, generator=gen, dtype=torch.float32) * 0.02
            dense = w.to(dtype)
            formats = {
                "int8": (torch.randint(-127, 128, (n, k), device=c.device, generator=gen, dtype=torch.int8),
                         torch.rand(n, device=c.device, generator=gen) * 1e-3, None, 0),
                "q4_1": (torch.randint(0, 16, (n, k), device=c.device, generator=gen, dtype=torch.int8),
                         torch.rand(n, k // 32, device=c.device, generator=gen) * 4e-3,
                         -torch.rand(n, k // 32, device=c.device, generator=gen) * 0.03, 32),
            }  # fmt: skip
            q4, s4, o4, _ = formats["q4_1"]
            formats["q4_1_packed"] = (pack_nibbles(q4), s4, o4, 32)  # what the CUDA linears keep for 4-bit formats
            del w
            for m in rows:
                x = torch.randn(m, k, device=c.device, generator=gen).to(dtype)
                row: dict[str, object] = {"k": k, "n": n, "m": m}
                row["f_linear_ms"] = _ms(lambda x=x, d=dense: torch.nn.functional.linear(x, d))
                for fmt, (q, s, o, g) in formats.items():
                    packed = fmt.endswith("_packed")
                    y = coded_matmul(x, q, s, o, g, packed=packed)
                    ref = ref_coded_matmul(x, q4 if packed else q, s, o, g).float()
                    err = ((y.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
                    worst = max(worst, err)
                    ms = _ms(lambda x=x, q=q, s=s, o=o, g=g, p=packed: coded_matmul(x, q, s, o, g, packed=p))
                    weight_bytes = sum(t.numel() * t.element_size() for t in (q, s, o) if t is not None)
                    row[f"{fmt}_ms"] = ms
                    row[f"{fmt}_rel_err"] = err
                    row[f"{fmt}_vs_f_linear"] = row["f_linear_ms"] / ms  # type: ignore[operator]
                    if m == 1:
                        gbs = weight_bytes / (ms * 1e-3) / 1e9
                        row[f"{fmt}_gbs"] = gbs
                        row[f"{fmt}_pct_hbm_peak"] = 100 * gbs / peak
                if m == 1:
                    dense_bytes = dense.numel() * dense.element_size()
                    row["f_linear_gbs"] = dense_bytes / (row["f_linear_ms"] * 1e-3) / 1e9  # type: ignore[operator]
                cases.append(row)
            del formats, dense
            free_gpu_memory()
        out[model] = cases
    out["worst_rel_err"] = worst
    # NOTE: bf16 tiles and output: ~2^-8 of the output's magnitude; a wrong scale, offset or tile is far above it
    assert worst < 2e-2, f"coded_matmul disagrees with the reference: relative error {worst:.3e}"
    return out


# ---- GGUF greedy -----------------------------------------------------------------------------------------------------
def write_gguf_model(src: Path, dst: Path) -> dict[str, str]:
    """`src` (a float32 safetensors Llama with its tokenizer) as a GGUF model directory `dst`: config and tokenizer
    files copied, the weights in `model.gguf` as llama.cpp lays them out (gguf-py's names, permuted Q/K rows), each
    matrix quantized by gguf-py in GGUF_KINDS by turns. Returns each quantized matrix's format."""
    import numpy as np
    from gguf import MODEL_ARCH, GGMLQuantizationType, get_tensor_name_map, quantize
    from safetensors.torch import load_file

    from engine_core.checkpoint.model_config import read_config_json
    from engine_core.checkpoint.model_dir import GGUF_LINK
    from engine_core.model.loader import load_config
    from tests.gguf_writer import finish, gguf_writer, llama_qk_heads, permute_qk

    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.is_file() and not f.name.endswith(".index.json"):
            shutil.copy(f, dst / f.name)
    cfg = load_config(str(src))
    raw = read_config_json(str(src))  # NOTE: the file's own rope_theta (newer configs nest it in rope_parameters)
    theta = float(raw.get("rope_theta") or (raw.get("rope_parameters") or {}).get("rope_theta"))
    writer = gguf_writer(dst / GGUF_LINK, "llama", cfg, theta)
    names = get_tensor_name_map(MODEL_ARCH.LLAMA, cfg.num_hidden_layers)
    state: dict[str, torch.Tensor] = {}
    for f in sorted(src.glob("*.safetensors")):
        state |= load_file(str(f))
    kinds: dict[str, str] = {}
    matrices = 0
    for hf, tensor in state.items():
        if hf == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        base, suffix = hf.rsplit(".", 1)
        name = f"{names.get_name(base)}.{suffix}"
        w = tensor.float().numpy()
        heads = llama_qk_heads(name, cfg)
        if heads is not None:
            w = permute_qk(w, heads)
        if w.ndim == 2 and w.shape[1] % 32 == 0:  # NOTE: rows not in whole blocks stay F32 (the dry run's tiny K)
            kind = GGMLQuantizationType[GGUF_KINDS[matrices % len(GGUF_KINDS)]]
            matrices += 1
            writer.add_tensor(name, quantize(np.ascontiguousarray(w), kind), raw_dtype=kind)
            kinds[hf] = kind.name
        else:
            writer.add_tensor(name, np.ascontiguousarray(w))
    finish(writer)
    return kinds


def _gguf_dir(c: Check) -> Path:
    if getattr(c, "_gguf_dir", None) is None:
        dst = c.model_dir().parent / (c.model_dir().name + "_gguf")
        c._gguf_kinds = write_gguf_model(c.model_dir(), dst)  # type: ignore[attr-defined]
        c._gguf_dir = dst  # type: ignore[attr-defined]
    return c._gguf_dir  # type: ignore[attr-defined,no-any-return]


def _prompts(c: Check, seed: int, lengths: tuple[int, ...]) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    vocab = int(c.shapes["vocab_size"])  # type: ignore[call-overload]
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


def _linear_methods(llm: object) -> list[str]:
    from engine_core.model.layers.linear import Linear

    model = llm.engine.runner.model  # type: ignore[attr-defined]
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    return sorted({f"{m.method.name}{'' if m.device_codes is None else ':codes'}" for m in linears})


def check_gguf_greedy(c: Check) -> dict[str, object]:
    from transformers import AutoModelForCausalLM

    from engine_core import LLM, SamplingParams
    from engine_core.checkpoint.model_dir import transformers_kwargs

    t0 = time.monotonic()
    model_dir = _gguf_dir(c)
    write_s = time.monotonic() - t0
    lengths = (1, 7, 17, 40) if c.dry_run else (1, 7, 16, 17, 40, 70, 300)
    prompts = _prompts(c, 3, lengths)
    n = 4 if c.dry_run else 32
    llm = LLM(str(model_dir), device=c.device, dtype="float32", num_kv_blocks=512, max_num_seqs=16,
              max_num_batched_tokens=256)  # fmt: skip
    methods = _linear_methods(llm)
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    codes = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                          use_tqdm=False)]  # fmt: skip
    llm.shutdown()
    del llm
    free_gpu_memory()
    hf_kwargs = transformers_kwargs(model_dir)
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **hf_kwargs).to(c.device).eval()
    hf = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p], device=c.device)
            out = ref.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
            hf.append(out[0, len(p) :].tolist())
    del ref
    agree = [
        next((i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), n)
        for x, y in zip(codes, hf, strict=True)
    ]
    result: dict[str, object] = {
        "formats": sorted(set(c._gguf_kinds.values())),  # type: ignore[attr-defined]
        "gguf_write_seconds": round(write_s, 1),
        "linear_methods": methods,
        "prompt_lengths": list(lengths),
        "new_tokens": n,
        "tokens_agreeing_per_prompt": agree,
        "float32_codes_eq_transformers": codes == hf,
    }
    assert result["float32_codes_eq_transformers"], {"codes": codes, "transformers": hf}
    return result


# ---- int8 ------------------------------------------------------------------------------------------------------------
def _top1(c: Check, model_dir: Path, dtype: str, prompts: list[list[int]], quantization: str | None) -> list[int]:
    from engine_core import LLM, SamplingParams

    llm = LLM(str(model_dir), device=c.device, dtype=dtype, num_kv_blocks=512, quantization=quantization,
              enforce_eager=True)  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    llm.shutdown()
    del llm
    free_gpu_memory()
    return [next(t for t, lp in pos.items() if lp.rank == 1) for o in outs for pos in (o.prompt_logprobs or []) if pos]


def _batch1_ms(c: Check, model_dir: Path, quantization: str | None) -> tuple[float, list[str]]:
    """Batch-1 decode ms/token (CUDA graphs on), bf16 activations (fp32 in a dry run)."""
    import argparse

    from engine_core import LLM

    throughput = importlib.import_module("offline_throughput")
    llm = LLM(str(model_dir), device=c.device, dtype=c.dtype, num_kv_blocks=512, max_num_seqs=16,
              quantization=quantization)  # fmt: skip
    methods = _linear_methods(llm)
    args = argparse.Namespace(batch1_prompt=16 if c.dry_run else 128, batch1_tokens=4 if c.dry_run else 128)
    throughput.pagoda_batch1(llm, args)  # warm-up: the first decode steps' graph replays and allocations
    ms = throughput.pagoda_batch1(llm, args)
    llm.shutdown()
    del llm
    free_gpu_memory()
    return ms, methods


def check_int8(c: Check) -> dict[str, object]:
    model_dir = c.model_dir()
    prompts = _prompts(c, 4, (7, 17, 40) if c.dry_run else (7, 17, 40, 70, 300, 600))
    ref = _top1(c, model_dir, "float32", prompts, None)
    runs = {"int8": (c.dtype, "int8"), "bfloat16": ("bfloat16", None), "int8_float32_activations": ("float32", "int8")}
    targets = {"int8": (model_dir, "int8"), "bfloat16": (model_dir, None), "gguf_codes": (None, None)}
    if c.dry_run:  # the wiring on this CPU: int8 only where the CPU path runs it (int8 dot products or AVX2)
        from engine_core.model.layers.cpu_bfloat16 import this_cpu_flags
        from engine_core.model.layers.cpu_int8 import int8_unsupported

        runs = {} if int8_unsupported(this_cpu_flags()) else {"int8": ("float32", "int8")}
        targets = {k: v for k, v in targets.items() if k != "int8" or runs}
    agreement = {}
    for name, (dtype, quantization) in runs.items():
        top = _top1(c, model_dir, dtype, prompts, quantization)
        assert len(top) == len(ref), (name, len(top), len(ref))
        agreement[name] = sum(a == b for a, b in zip(top, ref, strict=True)) / len(ref)
    result: dict[str, object] = {"positions": len(ref), "top1_agreement_with_float32": agreement}
    batch1: dict[str, object] = {}
    for name, (path, quantization) in targets.items():
        try:
            ms, methods = _batch1_ms(c, path or _gguf_dir(c), quantization)
            batch1[name] = {"ms_per_token": ms, "linear_methods": methods}
        except Exception as e:  # e.g. no gguf-py on the device: the others still run
            batch1[name] = {"error": f"{type(e).__name__}: {e}"}
    result["batch1_decode"] = batch1
    result["batch1_dtype"] = c.dtype
    # NOTE: a failed run fails the sub-check (run() reads `errors`) without losing the others' numbers
    result["errors"] = [k for k, v in batch1.items() if "error" in v]  # type: ignore[operator]
    return result
