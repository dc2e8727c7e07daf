"""Quality per weight format: perplexity over a fixed public text, top-1 agreement with the first format per position,
and greedy outputs on the equality prompts (tests/test_greedy_equality.py).

The text is the license file that the installed `grpcio` distribution ships (Apache-2.0, then BSD-3-Clause and
MPL-2.0 texts): public, fixed by the pinned version, not written by this project; its sha256 is printed with the
results. It is tokenized with the model's tokenizer and cut into windows of `--window` tokens; each window is one
prompt whose `prompt_logprobs` give the log-probability of every token after the first and the top-1 token there.

Formats (`--formats`, the first is the reference of the agreement columns):
- `float32`: the model's float32 safetensors export (benchmarks/peer_model.py: the GGUF blocks decoded, bit for bit
  transformers' tensors; the CPU linears find those blocks' codes and compute from them, float32's bits);
- `gguf`: the `.gguf` model itself, `quantization="gguf"` (the weights computed from their codes);
- `gguf_a8`: the `.gguf` model with `quantization="gguf_a8"` (its 4-bit codes times 8-bit activations);
- `int8`: the float32 export with `quantization="int8"` (per-channel int8 weights: W8A8 from a few rows on a CPU with
  int8 dot products, weight-only at every row count without them);
- a path ending in `.gguf`: that file, computed from its codes; `--gguf-types Q4_K_M,...` adds the default model
  quantized by llama.cpp's own quantizer to each type (benchmarks/kquant_files.py: from a float32 GGUF of the
  Q4_1 file's decoded weights, so every such file is a re-quantization of Q4_1 and float32 is their reference).
A format may name its `dtype` and `kv_cache_dtype` after it, `WEIGHTS[:DTYPE[:KV_CACHE_DTYPE]]`
(`float32:bfloat16` is bf16 GEMMs with "auto", i.e. a bf16 KV cache; `float32:float32:bfloat16` a bf16 KV cache
alone); otherwise `--dtype` and "auto".

For the GGUF formats, `--transformers` also checks that the greedy outputs equal transformers' float32 decoding of
the same file (tests/hf_reference.py's `hf_greedy`), and `--llama-cpp` counts the prompts whose greedy outputs equal
llama.cpp's on the same file (the peer of benchmarks/peers/install_llama_cpp.sh; informative, no test depends on it).

    PYTHONPATH=$PWD python benchmarks/quality.py [--formats float32,gguf,gguf_a8,float32:bfloat16,int8] [--dtype auto]
        [--gguf-types Q4_K_M,Q5_K_M,Q6_K,Q8_0] [--transformers] [--llama-cpp [--llama-venv DIR]]
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import math
import os
import time
from dataclasses import dataclass, field

TEXT_DISTRIBUTION, TEXT_FILE = "grpcio", "licenses/LICENSE"


@dataclass
class FormatResult:
    name: str
    seconds: float
    perplexity: float
    top1: list[int]  # the most likely next token at every scored position, windows concatenated
    greedy: list[list[int]]  # greedy outputs on the equality prompts
    gguf_path: str | None = None  # the file, for a format computed from GGUF codes
    peers: dict[str, int] = field(default_factory=dict)  # peer -> prompts whose greedy outputs equal this format's


def public_text() -> tuple[str, str]:
    """The fixed public text and its sha256 (first 12 hex digits)."""
    text = importlib.metadata.distribution(TEXT_DISTRIBUTION).read_text(TEXT_FILE)
    if not text:
        raise FileNotFoundError(f"{TEXT_DISTRIBUTION} ships no {TEXT_FILE}")
    return text, hashlib.sha256(text.encode()).hexdigest()[:12]


def windows(ids: list[int], window: int, max_windows: int) -> list[list[int]]:
    cut = [ids[i : i + window] for i in range(0, len(ids) - 1, window)]
    cut = [w for w in cut if len(w) > 1]
    return cut[:max_windows] if max_windows > 0 else cut


def run_format(
    name: str, model: str, args: argparse.Namespace, texts: list[list[int]], prompts: list[list[int]]
) -> FormatResult:
    from engine_core import LLM, SamplingParams
    from tests.test_greedy_equality import GREEDY

    weights, dtype, kv_cache_dtype = (name.split(":") + [args.dtype, "auto"][name.count(":") :])[:3]
    quantization = "gguf" if weights.endswith(".gguf") else weights if weights in ("gguf", "gguf_a8", "int8") else None
    t0 = time.perf_counter()
    llm = LLM(
        model,
        dtype=dtype,
        kv_cache_dtype=kv_cache_dtype,
        quantization=quantization,
        kv_cache_memory=args.kv_cache_memory,
    )
    scored = llm.generate(
        [{"prompt_token_ids": w} for w in texts],
        SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1),
        use_tqdm=False,
    )
    nll, count, top1 = 0.0, 0, []
    for window, out in zip(texts, scored, strict=True):
        assert out.prompt_logprobs is not None
        for token, position in zip(window[1:], out.prompt_logprobs[1:], strict=True):
            assert position is not None
            nll -= position[token].logprob
            count += 1
            top1.append(next(t for t, lp in position.items() if lp.rank == 1))
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    greedy = [list(o.outputs[0].token_ids) for o in outs]
    seconds = time.perf_counter() - t0
    return FormatResult(name, seconds, math.exp(nll / count), top1, greedy, model if quantization == "gguf" else None)


def transformers_greedy(gguf_path: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """transformers' float32 greedy outputs on the file (it dequantizes the GGUF itself, with gguf-py)."""
    import torch
    from transformers import AutoModelForCausalLM

    from engine_core.checkpoint.model_dir import transformers_kwargs
    from engine_core.checkpoint.model_files import resolve_model_dir
    from engine_core.config import default_cache_dir
    from tests.hf_reference import hf_greedy

    model_dir = resolve_model_dir(gguf_path, default_cache_dir())
    kwargs = transformers_kwargs(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **kwargs).eval()
    return [hf_greedy(model, p, max_tokens) for p in prompts]


def gguf_path_of(model: str) -> str:
    """The .gguf file of a model given as the file or as Pagoda's cached directory of one."""
    from engine_core.checkpoint.model_dir import gguf_file

    return str(gguf_file(model)) if os.path.isdir(model) else model


def format_label(name: str) -> str:
    weights, sep, rest = name.partition(":")
    return (os.path.basename(weights) if weights.endswith(".gguf") else weights) + sep + rest


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a .gguf file or its directory (default SmolLM2-135M-Instruct)")
    ap.add_argument(
        "--formats",
        default="float32,gguf",
        help="comma list of float32, gguf, int8 or a .gguf path, each [:dtype[:kv_cache_dtype]]; the first is the "
        "reference",
    )
    ap.add_argument("--gguf-types", default="", help="also these llama.cpp quantizations (benchmarks/kquant_files.py)")
    ap.add_argument("--transformers", action="store_true", help="GGUF formats: greedy vs transformers on the file")
    ap.add_argument("--llama-cpp", action="store_true", help="GGUF formats: greedy vs llama.cpp on the file")
    ap.add_argument("--llama-venv", default=None, help="the llama.cpp peer's venv (default: the install script's)")
    ap.add_argument("--peer-prompts", type=int, default=0, help="compare the first N prompts with the peers (0: all)")
    ap.add_argument("--dtype", default="auto", help="passed to every LLM (float32, bfloat16, ...)")
    ap.add_argument("--window", type=int, default=512, help="tokens per scored window")
    ap.add_argument("--max-windows", type=int, default=0, help="score only the first N windows (0: all)")
    ap.add_argument("--kv-cache-memory", type=float, default=0.1, help="GiB per LLM")
    args = ap.parse_args()

    from peer_model import peer_model_dir

    from engine_core.checkpoint.model_files import resolve_model_dir
    from engine_core.config import default_cache_dir
    from engine_core.io.tokenizer import load_tokenizer
    from tests.test_greedy_equality import MAX_TOKENS, PROMPTS

    cache = default_cache_dir()
    model_dir = resolve_model_dir(args.model, cache)
    export = peer_model_dir(model_dir, cache)
    models = {"gguf": model_dir, "gguf_a8": model_dir, "float32": export, "int8": export}
    text, digest = public_text()
    tokenizer = load_tokenizer(model_dir, cache)
    texts = windows(tokenizer.encode(text), args.window, args.max_windows)
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    print(
        f"text: {TEXT_DISTRIBUTION} {importlib.metadata.version(TEXT_DISTRIBUTION)} {TEXT_FILE} (sha256 {digest}), "
        f"{sum(len(w) - 1 for w in texts)} scored tokens in {len(texts)} windows; dtype {args.dtype}"
    )
    names = args.formats.split(",")
    if args.gguf_types:
        from kquant_files import kquant_files

        files = kquant_files(args.gguf_types.split(","), args.model, args.llama_venv)
        names += [files[t] for t in args.gguf_types.split(",")]
    results = []
    llama = None
    if args.llama_cpp:
        from llama_cpp_client import LlamaCpp

        llama = LlamaCpp(args.llama_venv)
    checked = prompts[: args.peer_prompts or len(prompts)]
    for name in names:
        weights = name.partition(":")[0]
        r = run_format(name, weights if weights.endswith(".gguf") else models[weights], args, texts, prompts)
        if r.gguf_path is not None and llama is not None:
            llama.load("m", gguf_path_of(r.gguf_path), n_ctx=512)
            theirs = [llama.generate("m", p, MAX_TOKENS, stop=[]).tokens for p in checked]
            r.peers["llama.cpp"] = sum(a == b for a, b in zip(r.greedy, theirs, strict=False))
        if r.gguf_path is not None and args.transformers:
            hf = transformers_greedy(r.gguf_path, checked, MAX_TOKENS)
            r.peers["transformers"] = sum(a == b for a, b in zip(r.greedy, hf, strict=False))
        results.append(r)
        # NOTE: each row as soon as it is known: on a loaded machine a long run may not reach the table.
        agree = sum(a == b for a, b in zip(r.top1, results[0].top1, strict=True)) / len(r.top1)
        print(
            f"{format_label(name)}: perplexity {r.perplexity:.4f}, top-1 agreement {agree * 100:.2f} %, "
            f"greedy identical {sum(a == b for a, b in zip(r.greedy, results[0].greedy, strict=True))}, "
            f"{r.seconds:.1f} s, of {len(checked)} prompts greedy = {r.peers}",
            flush=True,
        )
    if llama is not None:
        llama.close()
    ref = results[0]
    peers = [p for p in ("transformers", "llama.cpp") if any(p in r.peers for r in results)]
    print(
        f"| format | perplexity | vs {format_label(ref.name)} | top-1 agreement | greedy outputs identical | "
        + "".join(f"greedy = {p} on the file | " for p in peers)
        + "seconds |"
    )
    print("| --- | ---: | ---: | ---: | ---: | " + "---: | " * len(peers) + "---: |")
    for r in results:
        agree = sum(a == b for a, b in zip(r.top1, ref.top1, strict=True)) / len(ref.top1)
        same = sum(a == b for a, b in zip(r.greedy, ref.greedy, strict=True))
        delta = (r.perplexity / ref.perplexity - 1) * 100
        cells = "".join(f"{r.peers[p]}/{len(checked)} | " if p in r.peers else "| " for p in peers)
        print(
            f"| {format_label(r.name)} | {r.perplexity:.4f} | {delta:+.3f} % | {agree * 100:.2f} % "
            f"| {same}/{len(ref.greedy)} | {cells}{r.seconds:.1f} |"
        )


if __name__ == "__main__":
    main()
