"""llama.cpp's side of the benchmarks, run by the llama.cpp peer's own interpreter
(benchmarks/peers/install_llama_cpp.sh), never by the project's: it imports llama_cpp and the standard library only.

One JSON request per stdin line, one JSON answer per stdout line prefixed with `@@ ` (llama.cpp may write its own
lines); benchmarks/llama_cpp_client.py is the other end. Requests (`op`):
- `quantize` {src, dst, ftype}: llama.cpp's own quantizer (`llama_model_quantize`, what `llama-quantize` calls) with
  its default parameters, `ftype` a `LLAMA_FTYPE_MOSTLY_*` suffix (Q4_K_M, Q8_0, ...);
- `load` {name, path, threads, n_ctx, num_pred_tokens}: a `llama_cpp.Llama` kept under `name`; with
  `num_pred_tokens` > 0 its draft model is `LlamaPromptLookupDecoding(num_pred_tokens=...)` (prompt lookup);
- `generate` {name, tokens, max_tokens, stop}: greedy (`temp=0`) from token ids, until a `stop` id or `max_tokens`;
  answers the tokens and the seconds from the call to the first token and to the last;
- `prefill` {name, tokens}: the seconds `Llama.eval` takes on the prompt, from an empty context.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import llama_cpp
from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

MODELS: dict[str, llama_cpp.Llama] = {}


def quantize(src: str, dst: str, ftype: str, threads: int) -> dict[str, Any]:
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    params.nthread = threads
    t0 = time.perf_counter()
    rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), params)
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize({src}, {ftype}) returned {rc}")
    return {"seconds": time.perf_counter() - t0}


def load(name: str, path: str, threads: int, n_ctx: int, num_pred_tokens: int) -> dict[str, Any]:
    draft = LlamaPromptLookupDecoding(num_pred_tokens=num_pred_tokens) if num_pred_tokens > 0 else None
    t0 = time.perf_counter()
    MODELS[name] = llama_cpp.Llama(
        model_path=path,
        n_threads=threads,
        n_threads_batch=threads,
        n_ctx=n_ctx,
        n_batch=512,
        draft_model=draft,
        verbose=False,
    )
    return {"seconds": time.perf_counter() - t0, "system_info": llama_cpp.llama_print_system_info().decode()}


def generate(name: str, tokens: list[int], max_tokens: int, stop: list[int]) -> dict[str, Any]:
    llm = MODELS[name]
    llm.reset()  # NOTE: no reuse of the previous request's KV prefix: every arm prefills the whole prompt
    out: list[int] = []
    t0 = time.perf_counter()
    first = last = t0
    for token in llm.generate(tokens, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0, reset=True):
        last = time.perf_counter()
        if not out:
            first = last
        out.append(int(token))
        if token in stop or len(out) >= max_tokens:
            break
    return {"tokens": out, "first_s": first - t0, "last_s": last - t0}


def prefill(name: str, tokens: list[int]) -> dict[str, Any]:
    llm = MODELS[name]
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(tokens)
    return {"seconds": time.perf_counter() - t0}


def main() -> None:
    for line in sys.stdin:
        req = json.loads(line)
        op = req.pop("op")
        try:
            if op == "quantize":
                ans = quantize(req["src"], req["dst"], req["ftype"], req.get("threads", 2))
            elif op == "load":
                ans = load(req["name"], req["path"], req["threads"], req["n_ctx"], req.get("num_pred_tokens", 0))
            elif op == "generate":
                ans = generate(req["name"], req["tokens"], req["max_tokens"], req.get("stop", []))
            elif op == "prefill":
                ans = prefill(req["name"], req["tokens"])
            elif op == "exit":
                return
            else:
                ans = {"error": f"unknown op {op!r}"}
        except Exception as e:  # NOTE: the parent gets the failure as an answer and decides; the child stays up
            ans = {"error": f"{type(e).__name__}: {e}"}
        print("@@ " + json.dumps(ans), flush=True)


if __name__ == "__main__":
    main()
