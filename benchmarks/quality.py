"""Quality per weight format: perplexity over a fixed public text, top-1 agreement with the first format per position,
and greedy outputs on the equality prompts (tests/test_greedy_equality.py).

The text is the license file that the installed `grpcio` distribution ships (Apache-2.0, then BSD-3-Clause and
MPL-2.0 texts): public, fixed by the pinned version, not written by this project; its sha256 is printed with the
results. It is tokenized with the model's tokenizer and cut into windows of `--window` tokens; each window is one
prompt whose `prompt_logprobs` give the log-probability of every token after the first and the top-1 token there.

Formats (`--formats`, the first is the reference of the agreement columns):
- `float32`: the model's float32 safetensors export (benchmarks/peer_model.py: the GGUF blocks decoded, bit for bit
  transformers' tensors), run without codes (float32 panels / oneDNN);
- `gguf`: the `.gguf` model itself, `quantization="gguf"` (the weights computed from their codes);
- `int8`: the float32 export with `quantization="int8"` (per-channel int8 weights, W8A8 from a few rows).
A format may name its `dtype` and `kv_cache_dtype` after it, `WEIGHTS[:DTYPE[:KV_CACHE_DTYPE]]`
(`float32:bfloat16` is bf16 GEMMs with "auto", i.e. a bf16 KV cache; `float32:float32:bfloat16` a bf16 KV cache
alone); otherwise `--dtype` and "auto".

    PYTHONPATH=$PWD python benchmarks/quality.py [--formats float32,gguf,float32:bfloat16,int8] [--dtype auto]
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import math
import time
from dataclasses import dataclass

TEXT_DISTRIBUTION, TEXT_FILE = "grpcio", "licenses/LICENSE"


@dataclass
class FormatResult:
    name: str
    seconds: float
    perplexity: float
    top1: list[int]  # the most likely next token at every scored position, windows concatenated
    greedy: list[list[int]]  # greedy outputs on the equality prompts


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
    quantization = weights if weights in ("gguf", "int8") else None
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
    greedy = [o.outputs[0].token_ids for o in outs]
    return FormatResult(name, time.perf_counter() - t0, math.exp(nll / count), top1, greedy)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a .gguf file or its directory (default SmolLM2-135M-Instruct)")
    ap.add_argument(
        "--formats",
        default="float32,gguf",
        help="comma list of float32, gguf, int8, each [:dtype[:kv_cache_dtype]]; the first is the reference",
    )
    ap.add_argument("--dtype", default="auto", help="passed to every LLM (float32, bfloat16, ...)")
    ap.add_argument("--window", type=int, default=512, help="tokens per scored window")
    ap.add_argument("--max-windows", type=int, default=0, help="score only the first N windows (0: all)")
    ap.add_argument("--kv-cache-memory", type=float, default=0.1, help="GiB per LLM")
    args = ap.parse_args()

    from peer_model import peer_model_dir

    from engine_core.checkpoint.model_files import resolve_model_dir
    from engine_core.config import default_cache_dir
    from engine_core.io.tokenizer import load_tokenizer
    from tests.test_greedy_equality import PROMPTS

    cache = default_cache_dir()
    model_dir = resolve_model_dir(args.model, cache)
    export = peer_model_dir(model_dir, cache)
    models = {"gguf": model_dir, "float32": export, "int8": export}
    text, digest = public_text()
    tokenizer = load_tokenizer(model_dir, cache)
    texts = windows(tokenizer.encode(text), args.window, args.max_windows)
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    print(
        f"text: {TEXT_DISTRIBUTION} {importlib.metadata.version(TEXT_DISTRIBUTION)} {TEXT_FILE} (sha256 {digest}), "
        f"{sum(len(w) - 1 for w in texts)} scored tokens in {len(texts)} windows; dtype {args.dtype}"
    )
    names = args.formats.split(",")
    results = [run_format(name, models[name.partition(":")[0]], args, texts, prompts) for name in names]
    ref = results[0]
    print("| format | perplexity | vs " + ref.name + " | top-1 agreement | greedy outputs identical | seconds |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for r in results:
        agree = sum(a == b for a, b in zip(r.top1, ref.top1, strict=True)) / len(ref.top1)
        same = sum(a == b for a, b in zip(r.greedy, ref.greedy, strict=True))
        delta = (r.perplexity / ref.perplexity - 1) * 100
        print(
            f"| {r.name} | {r.perplexity:.4f} | {delta:+.3f} % | {agree * 100:.2f} % | {same}/{len(ref.greedy)} "
            f"| {r.seconds:.1f} |"
        )


if __name__ == "__main__":
    main()
