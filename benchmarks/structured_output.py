"""Structured output's cost, offline on the real model (engine_core.LLM), arms interleaved in one process:

- `engine`: 64 concurrent requests with JSON schemas against the same 64 unconstrained (total output tok/s), and
  batch-1 time per output token with and without a schema; each arm `--rounds` times, alternating.
- `latency`: batch 1, what a schema adds to TTFT when it is new (compiled behind the compile gate) and when it is
  cached, over `--rounds` new variants of each schema (p50 of the paired differences against an unconstrained
  request), and the decode-only time per output token (TPOT: first token to last, prefill excluded), schema against
  unconstrained.
- `backends`: the grammar engines side by side on the model's tokenizer (llguidance, and xgrammar where installed):
  tokenizer load, compile time per schema, first and steady mask time along a random walk through the grammar.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/structured_output.py engine [--rounds 3] [--max-tokens 96]
    PYTHONPATH=$PWD .venv/bin/python benchmarks/structured_output.py latency [--rounds 4]
    PYTHONPATH=$PWD .venv/bin/python benchmarks/structured_output.py backends

Side by side with vLLM-CPU's structured output: benchmarks/structured_output_peers.py.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

from engine_core import LLM, SamplingParams, StructuredOutputsParams
from engine_core.checkpoint.model_files import resolve_model_dir
from engine_core.config import default_cache_dir

SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 24},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "email": {"type": "string", "pattern": "^[a-z]{1,12}@[a-z]{1,12}\\.com$"},
        },
        "required": ["name", "age", "email"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "minItems": 1,
                "maxItems": 4,
                "items": {
                    "type": "object",
                    "properties": {"id": {"type": "integer"}, "tag": {"enum": ["red", "green", "blue"]}},
                    "required": ["id", "tag"],
                },
            },
            "score": {"anyOf": [{"type": "number", "minimum": -1, "maximum": 1}, {"type": "null"}]},
        },
        "required": ["items", "score"],
    },
    {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 30},
            "country": {"type": "string", "maxLength": 30},
            "population": {"type": "integer", "minimum": 0},
            "facts": {"type": "array", "items": {"type": "string", "maxLength": 40}, "maxItems": 3},
        },
        "required": ["city", "country", "population", "facts"],
    },
]
PROMPT = "Describe a person, a city or an inventory as JSON. Be concise.\n"


def run(llm: LLM, n: int, constrained: bool, max_tokens: int) -> tuple[int, float]:
    params = []
    for i in range(n):
        so = StructuredOutputsParams(json=SCHEMAS[i % len(SCHEMAS)]) if constrained else None
        params.append(SamplingParams(temperature=0.7, seed=i, max_tokens=max_tokens, structured_outputs=so))
    t0 = time.perf_counter()
    outs = llm.generate([PROMPT + f"Item {i}:" for i in range(n)], params, use_tqdm=False)
    wall = time.perf_counter() - t0
    return sum(len(c.token_ids) for o in outs for c in o.outputs), wall


def engine(args: argparse.Namespace) -> None:
    llm = LLM(resolve_model_dir(None, default_cache_dir()), kv_cache_memory=1.0)
    run(llm, 4, True, 8)  # warm-up (and the tokenizer's background load)
    results: dict[str, list[float]] = {k: [] for k in ("64 plain", "64 schema", "1 plain", "1 schema")}
    for _ in range(args.rounds):
        for constrained in (False, True):
            arm = "schema" if constrained else "plain"
            tokens, wall = run(llm, 64, constrained, args.max_tokens)
            results[f"64 {arm}"].append(tokens / wall)
            print(f"64 {arm}: {tokens} tokens in {wall:.1f} s", flush=True)
            tokens, wall = run(llm, 1, constrained, args.max_tokens)
            results[f"1 {arm}"].append(wall / tokens * 1e3)
            print(f"1 {arm}: {tokens} tokens in {wall:.2f} s", flush=True)
    for name, values in results.items():
        unit = "tok/s" if name.startswith("64") else "ms/token"
        print(f"{name:10s} median {statistics.median(values):8.2f} {unit}  runs {[round(v, 2) for v in values]}")
    print(
        f"64 concurrent: schema/plain tok/s = {statistics.median(results['64 schema']) / statistics.median(results['64 plain']):.3f}; "  # noqa: E501
        f"batch 1: schema/plain ms/token = {statistics.median(results['1 schema']) / statistics.median(results['1 plain']):.3f}"  # noqa: E501
    )


def variant(schema: dict, i: int) -> dict:
    """The schema under a new cache key (a `description`, which constrains nothing): compiled in full again."""
    return {**schema, "description": f"variant {i}"}


def one(llm: LLM, schema: dict | None, max_tokens: int, seed: int = 0) -> tuple[float, float, int, float]:
    """One request alone: (TTFT s, decode-only s per output token after the first, output tokens, time in queue s:
    arrival to first scheduled, where the compile gate holds a new grammar)."""
    so = StructuredOutputsParams(json=schema) if schema is not None else None
    params = SamplingParams(temperature=0.7, seed=seed, max_tokens=max_tokens, structured_outputs=so)
    out = llm.generate([PROMPT + "Item 0:"], params, use_tqdm=False)[0]
    m = out.metrics
    assert m is not None and m.first_token_time is not None and m.finished_time is not None
    n = len(out.outputs[0].token_ids)
    tpot = (m.finished_time - m.first_token_time) / (n - 1) if n > 1 else float("nan")
    queued = m.time_in_queue
    assert queued is not None
    return m.first_token_time - m.arrival_time, tpot, n, queued


def latency(args: argparse.Namespace) -> None:
    llm = LLM(resolve_model_dir(None, default_cache_dir()), kv_cache_memory=1.0)
    run(llm, 4, True, 8)  # warm-up (and the tokenizer's background load)
    new, cached = [], []
    queued: dict[str, list[float]] = {"plain": [], "new": [], "cached": []}
    for r in range(args.rounds):
        for i, schema in enumerate(SCHEMAS):
            fresh = variant(schema, r * len(SCHEMAS) + i + 1)
            runs = {"plain": one(llm, None, 1), "new": one(llm, fresh, 1), "cached": one(llm, fresh, 1)}
            new.append(runs["new"][0] - runs["plain"][0])
            cached.append(runs["cached"][0] - runs["plain"][0])
            for arm, res in runs.items():
                queued[arm].append(res[3])
            print(", ".join(f"{a} TTFT {v[0] * 1e3:.1f} ms (queued {v[3] * 1e3:.1f})" for a, v in runs.items()))
    print(
        f"TTFT added by a schema, p50 over {len(new)} paired runs: new {statistics.median(new) * 1e3:.1f} ms, "
        f"cached {statistics.median(cached) * 1e3:.1f} ms"
    )
    print("time in queue p50: " + ", ".join(f"{a} {statistics.median(v) * 1e3:.1f} ms" for a, v in queued.items()))
    tpot: dict[str, list[float]] = {"plain": [], "schema": []}
    tokens: dict[str, int] = {"plain": 0, "schema": 0}
    for r in range(args.rounds):
        for i, schema in enumerate(SCHEMAS):
            for arm, sch in (("plain", None), ("schema", schema)):
                _, t, n, _ = one(llm, sch, args.max_tokens, seed=r * 10 + i)
                tpot[arm].append(t)
                tokens[arm] += n
    p, c = statistics.median(tpot["plain"]), statistics.median(tpot["schema"])
    print(
        f"batch-1 TPOT (decode only) median: plain {p * 1e3:.2f} ms ({tokens['plain']} tokens), "
        f"schema {c * 1e3:.2f} ms ({tokens['schema']} tokens); schema/plain {c / p:.3f}"
    )


def walk(fill, consume, vocab: int, steps: int = 64) -> list[float]:
    rng = np.random.default_rng(0)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        mask = fill()
        times.append(time.perf_counter() - t0)
        allowed = np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little")[:vocab])
        if not len(allowed) or not consume(int(rng.choice(allowed))):
            break
    return times


def backends(args: argparse.Namespace) -> None:
    import llguidance
    import llguidance.numpy as llg_numpy

    from engine_core.structured_output.grammar import to_grammar

    model_dir = resolve_model_dir(None, default_cache_dir())
    vocab = json.loads(Path(model_dir, "config.json").read_text())["vocab_size"]
    t0 = time.perf_counter()
    tok = llguidance.LLTokenizer(Path(model_dir, "tokenizer.json").read_text(), n_vocab=vocab, eos_token=2)
    print(f"llguidance tokenizer load {time.perf_counter() - t0:.3f} s")
    for i, schema in enumerate(SCHEMAS):
        t0 = time.perf_counter()
        m = llguidance.LLMatcher(tok, to_grammar(StructuredOutputsParams(json=schema)))
        compile_ms = (time.perf_counter() - t0) * 1e3
        buf = llg_numpy.allocate_token_bitmask(1, vocab)

        def fill(m=m, buf=buf) -> np.ndarray:
            llg_numpy.fill_next_token_bitmask(m, buf, 0)
            return buf[0]

        ts = walk(fill, lambda t, m=m: m.consume_token(t) and not m.is_stopped(), vocab)
        print(
            f"llguidance schema {i}: compile {compile_ms:.2f} ms, first mask {ts[0] * 1e3:.3f} ms, "
            f"median mask {statistics.median(ts) * 1e6:.1f} us"
        )
    from engine_core.structured_output.guidance import backend_for_model

    backend = backend_for_model(model_dir, vocab, 2)
    assert backend is not None
    backend.matcher(StructuredOutputsParams(json=SCHEMAS[0]))  # the miss (and the tokenizer's load)
    hits = []
    for _ in range(50):
        t0 = time.perf_counter()
        backend.matcher(StructuredOutputsParams(json=SCHEMAS[0]))
        hits.append(time.perf_counter() - t0)
    print(f"GuidanceBackend.matcher on a cache hit: median {statistics.median(hits) * 1e6:.1f} us")
    try:
        import xgrammar
        from transformers import AutoTokenizer
    except ImportError:
        print("xgrammar not installed")
        return
    t0 = time.perf_counter()
    info = xgrammar.TokenizerInfo.from_huggingface(AutoTokenizer.from_pretrained(model_dir), vocab_size=vocab)
    compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    print(f"xgrammar tokenizer load {time.perf_counter() - t0:.3f} s")
    for i, schema in enumerate(SCHEMAS):
        t0 = time.perf_counter()
        compiled = compiler.compile_json_schema(json.dumps(schema))
        compile_ms = (time.perf_counter() - t0) * 1e3
        xm = xgrammar.GrammarMatcher(compiled)
        xbuf = xgrammar.allocate_token_bitmask(1, vocab)

        def xfill(xm=xm, xbuf=xbuf) -> np.ndarray:
            xm.fill_next_token_bitmask(xbuf, 0)
            return xbuf[0].numpy()

        ts = walk(xfill, lambda t, xm=xm: xm.accept_token(t) and not xm.is_terminated(), vocab)
        print(
            f"xgrammar   schema {i}: compile {compile_ms:.2f} ms, first mask {ts[0] * 1e3:.3f} ms, "
            f"median mask {statistics.median(ts) * 1e6:.1f} us"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["engine", "latency", "backends"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=96)
    args = parser.parse_args()
    {"engine": engine, "latency": latency, "backends": backends}[args.mode](args)


if __name__ == "__main__":
    main()
