"""Pagoda against llama.cpp at batch 1 on the same GGUF files, engines alternated in one process and one window.

llama.cpp (through llama-cpp-python, benchmarks/peers/install_llama_cpp.sh) is what CPU users of GGUF files pick.
Both engines get the same file, the same token ids (Pagoda's tokenizer and chat template), 2 threads, greedy, and
are timed inside each one's Python API (Pagoda `LLM.generate`, llama.cpp `Llama.generate` in a child process on the
peer's own interpreter, benchmarks/llama_cpp_client.py):
1. decode: the batch-1 case of benchmarks/workload.py (128 random prompt ids, 128 new tokens, ignore_eos), ms per
   output token after the first (Pagoda: the request's `metrics`, first token to finish; llama.cpp: first yield to
   last);
2. prompt processing: a 512-token prompt of random ids, prompt tokens per second up to the first token;
3. speculation, on the default model's file: benchmarks/spec_decode.py's input-grounded prompts (its `GROUNDED`
   list), stopping at EOS, ms per output token with speculation off and on per engine: Pagoda's `ngram` and
   `suffix` methods (each with its default `num_speculative_tokens`), llama.cpp's prompt-lookup decoding
   (`LlamaPromptLookupDecoding(num_pred_tokens=N)`, whose docs say 10 suits GPUs and 2 CPU-only machines).
Every case alternates the engines (and arms) for `--rounds` rounds, the first arm rotating. Greedy agreement is
reported (between engines, and llama.cpp's lookup against its own off arm), never asserted across engines; Pagoda's
arms must agree (speculation is exact).

    PYTHONPATH=$PWD python benchmarks/llama_cpp_peer.py [--gguf-types Q4_K_M] [--rounds 3] [--num-pred-tokens 2,10]

Appends one JSON line to benchmarks/results/llama_cpp_peer.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import time
from pathlib import Path
from typing import Any

from llama_cpp_client import LlamaCpp
from spec_decode import GROUNDED
from workload import BATCH1_TOKENS, batch1_prompt

RESULTS = Path(__file__).parent / "results" / "llama_cpp_peer.jsonl"


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def pagoda_llm(path: str, args: argparse.Namespace, spec: dict[str, Any] | None = None) -> Any:
    from engine_core import LLM

    # NOTE: no prefix cache: every arm and round prefills its whole prompt, as llama.cpp does after `reset`.
    return LLM(
        path,
        num_threads=args.threads,
        kv_cache_memory=args.kv_cache_memory,
        enable_prefix_caching=False,
        speculative_config=spec,
    )


def pagoda_generate(llm: Any, ids: list[int], max_tokens: int, ignore_eos: bool) -> tuple[list[int], float, float]:
    """(tokens, seconds to the first token, ms per output token after the first)."""
    from engine_core import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=ignore_eos)
    out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
    m = out.metrics
    tokens = list(out.outputs[0].token_ids)
    ms = (m.finished_time - m.first_token_time) * 1000 / max(1, len(tokens) - 1)
    return tokens, m.first_token_time - m.arrival_time, ms


def plain_case(llm: Any, llama: LlamaCpp, args: argparse.Namespace, label: str) -> dict[str, Any]:
    """Decode ms/token and prompt tok/s, both engines alternated."""
    decode = batch1_prompt()
    long = [random.Random(1).randrange(1000, 40000) for _ in range(args.prompt_len)]
    pagoda_generate(llm, decode[:16], 4, True)  # warm-up, both engines
    llama.generate("off", decode[:16], 4, [])
    ms: dict[str, list[float]] = {"pagoda": [], "llama.cpp": []}
    pp: dict[str, list[float]] = {"pagoda": [], "llama.cpp": []}
    same = 0
    for r in range(args.rounds):
        for engine in ["pagoda", "llama.cpp"][:: 1 if r % 2 == 0 else -1]:
            if engine == "pagoda":
                ours, _, t = pagoda_generate(llm, decode, BATCH1_TOKENS, True)
                _, first, _ = pagoda_generate(llm, long, 1, True)
            else:
                g = llama.generate("off", decode, BATCH1_TOKENS, [])
                theirs, t = g.tokens, g.ms_per_token
                first = llama.generate("off", long, 1, []).first_s
            ms[engine].append(t)
            pp[engine].append(args.prompt_len / first)
        same += ours == theirs
        print(f"{label} round {r}: ms/token {ms['pagoda'][-1]:.2f} / {ms['llama.cpp'][-1]:.2f}, prompt tok/s "
              f"{pp['pagoda'][-1]:.0f} / {pp['llama.cpp'][-1]:.0f}", flush=True)  # fmt: skip
    return {"ms_per_token": ms, "prompt_tok_s": pp, "greedy_identical_rounds": same}


def spec_case(path: str, llama: LlamaCpp, args: argparse.Namespace) -> dict[str, Any]:
    """Grounded prompts, speculation off and on per engine, all arms alternated prompt by prompt."""
    from engine_core.spec_decode.config import SpeculativeConfig
    from engine_core.spec_decode.drafter import Drafter
    from engine_core.spec_decode.stats import SpecDecodeStats

    k = {"num_speculative_tokens": args.num_speculative_tokens} if args.num_speculative_tokens else {}
    specs = {m: {"method": m, **k} for m in ("ngram", "suffix")}
    llm = pagoda_llm(path, args, specs["ngram"])
    # NOTE: one engine, its drafter swapped between requests (as benchmarks/spec_decode.py does): the same weights
    # and KV cache serve every Pagoda arm.
    drafters: dict[str, Any] = {"pagoda off": None}
    for method, spec in specs.items():
        parsed = SpeculativeConfig.parse(spec)
        assert parsed is not None
        drafters[f"pagoda {method}"] = Drafter(parsed)
        drafters[f"pagoda {method}"].stats = SpecDecodeStats()
    lookups = [int(n) for n in args.num_pred_tokens.split(",")]
    for n in lookups:
        llama.load(f"lookup{n}", path, n_ctx=2048, num_pred_tokens=n)
    arms = list(drafters) + ["llama.cpp off"] + [f"llama.cpp lookup {n}" for n in lookups]
    tok = llm.tokenizer
    eos = [int(llm.engine.eos_token_id)]  # NOTE: the one id Pagoda stops at (`with_eos`), given to llama.cpp too
    ms: dict[str, list[float]] = {a: [] for a in arms}
    tokens: dict[str, list[list[int]]] = {a: [] for a in arms}
    for r in range(args.rounds):
        for i, prompt in enumerate(GROUNDED):
            ids = list(tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True))
            shift = (r + i) % len(arms)
            for arm in arms[shift:] + arms[:shift]:
                if arm.startswith("pagoda"):
                    llm.core.scheduler.drafter = drafters[arm]
                    out, _, t = pagoda_generate(llm, ids, args.max_tokens, False)
                else:
                    name = "off" if arm.endswith("off") else f"lookup{arm.rsplit(' ', 1)[1]}"
                    g = llama.generate(name, ids, args.max_tokens, eos)
                    out, t = g.tokens, g.ms_per_token
                ms[arm].append(t)
                tokens[arm].append(out)
            assert tokens["pagoda ngram"][-1] == tokens["pagoda off"][-1] == tokens["pagoda suffix"][-1]
            print(f"grounded round {r} prompt {i}: " + ", ".join(f"{a} {ms[a][-1]:.2f}" for a in arms), flush=True)
    result: dict[str, Any] = {}
    for arm in arms:
        ref = tokens["llama.cpp off" if arm.startswith("llama") else "pagoda off"]
        row: dict[str, Any] = {
            "ms_per_token": mean(ms[arm]),
            "per_prompt": ms[arm],
            "speedup": mean(ms["llama.cpp off" if arm.startswith("llama") else "pagoda off"]) / mean(ms[arm]),
            "output_tokens": sum(len(t) for t in tokens[arm]),
            "identical_to_own_off": sum(a == b for a, b in zip(tokens[arm], ref, strict=True)),
            "identical_to_pagoda_off": sum(a == b for a, b in zip(tokens[arm], tokens["pagoda off"], strict=True)),
        }
        drafter = drafters.get(arm)
        if drafter is not None:
            row |= {
                "acceptance_rate": drafter.stats.acceptance_rate,
                "mean_accepted_length": drafter.stats.mean_accepted_length,
            }
        result[arm] = row
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a .gguf file (default SmolLM2-135M-Instruct Q4_1)")
    ap.add_argument("--gguf-types", default="Q4_K_M", help="also these llama.cpp quantizations (kquant_files.py)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kv-cache-memory", type=float, default=0.25, help="GiB for Pagoda")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=160, help="speculation case, per prompt")
    ap.add_argument(
        "--num-speculative-tokens", type=int, default=0, help="Pagoda's ngram and suffix (0: each method's default)"
    )
    ap.add_argument("--num-pred-tokens", default="2,10", help="llama.cpp's prompt lookup, one arm each")
    ap.add_argument("--llama-venv", default=None, help="the llama.cpp peer's venv (default: the install script's)")
    ap.add_argument("--skip-spec", action="store_true")
    args = ap.parse_args()
    from kquant_files import kquant_files

    from engine_core.checkpoint.model_dir import gguf_file
    from engine_core.checkpoint.model_files import resolve_model_dir
    from engine_core.config import default_cache_dir

    default = str(Path(str(gguf_file(resolve_model_dir(args.model, default_cache_dir())))).resolve())
    types = [t for t in args.gguf_types.split(",") if t]
    files = {Path(default).stem: default} | {
        t: p for t, p in kquant_files(types, args.model, args.llama_venv).items() if t != "F32"
    }
    result: dict[str, Any] = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "host": platform.node(),
        "load": [os.getloadavg()],
    }
    with LlamaCpp(args.llama_venv, threads=args.threads) as llama:
        for label, path in files.items():
            llm = pagoda_llm(path, args)
            result["llama_cpp_system_info"] = llama.load("off", path, n_ctx=2048)
            result[label] = plain_case(llm, llama, args, label)
            del llm
        if not args.skip_spec:
            result["grounded"] = spec_case(default, llama, args)
    result["load"].append(os.getloadavg())
    print(json.dumps(result, indent=1))
    RESULTS.parent.mkdir(exist_ok=True)
    with RESULTS.open("a") as f:
        f.write(json.dumps(result) + "\n")
    print(f"load average at start / end: {result['load'][0]} / {result['load'][1]}")
    print("| file | engine | decode ms/token | prompt tok/s (512) |\n| --- | --- | ---: | ---: |")
    for label in files:
        for engine in ("pagoda", "llama.cpp"):
            row = result[label]
            print(f"| {label} | {engine} | {mean(row['ms_per_token'][engine]):.2f} | "
                  f"{mean(row['prompt_tok_s'][engine]):.0f} |")  # fmt: skip
    if "grounded" in result:
        print("| arm | ms/token | speed-up vs own off | acceptance | outputs = own off | = Pagoda off |")
        print("| --- | ---: | ---: | ---: | ---: | ---: |")
        n = len(GROUNDED) * args.rounds
        for arm, row in result["grounded"].items():
            acc = f"{row['acceptance_rate'] * 100:.0f} %" if "acceptance_rate" in row else ""
            print(f"| {arm} | {row['ms_per_token']:.2f} | {row['speedup']:.2f}x | {acc} | "
                  f"{row['identical_to_own_off']}/{n} | {row['identical_to_pagoda_off']}/{n} |")  # fmt: skip


if __name__ == "__main__":
    main()
