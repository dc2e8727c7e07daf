"""Tensor parallelism's cost on a CPU host, and its memory per rank.

`--mode cost`: a tiny random Llama (4 layers, hidden 256, 8 heads / 4 KV heads, intermediate 1024, vocab 8192),
arms alternated in fresh processes, `--rounds` times: TP=1 with 2 threads (native decode step), TP=1 with 2 threads
and the layer loop (what TP decode steps run), TP=1 with 1 thread, TP=2 with 1 thread per rank. Each: 16 prompts of
32 tokens, 64 new tokens (ignore_eos), offline; reports total tok/s, and for TP=2 the seconds rank 0 spent in
collectives.

`--mode allreduce`: two processes, one thread each, a gloo group on loopback: the median time of one all-reduce of
a `[16, 256]` float32 tensor (the tiny model's 16-row decode step) over 2,000 calls: the transfer's own cost.

`--mode memory`: the default model (SmolLM2-135M Q4_1) at `--size` ranks and at 1: each process's RSS after one
short generate (VmRSS of rank 0 = this process, and of each rank process).

    python benchmarks/tensor_parallel.py --mode cost --rounds 2
    python benchmarks/tensor_parallel.py --mode allreduce
    python benchmarks/tensor_parallel.py --mode memory --size 3
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
NUM_PROMPTS, PROMPT_LEN, NEW_TOKENS = 16, 32, 64
ARMS = {
    "tp1-2threads": (1, 2, True),
    "tp1-2threads-layer-loop": (1, 2, False),
    "tp1-1thread": (1, 1, True),
    "tp2-1thread-per-rank": (2, 1, False),
}


def make_tiny(path: Path) -> None:
    import shutil

    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from engine_core.checkpoint.model_files import resolve_model_dir
    from engine_core.config import default_cache_dir

    config = LlamaConfig(
        vocab_size=8192,
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    tokenizer_dir = Path(resolve_model_dir(None, default_cache_dir()))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, path / name)


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def run_arm(model: str, size: int, threads: int, native: bool) -> dict[str, float]:
    from engine_core import LLM, SamplingParams
    from engine_core.distributed.collectives import CLOCK

    llm = LLM(model, tensor_parallel_size=size, num_threads=threads, kv_cache_memory=0.1)
    if not native:
        llm.engine.runner.decode_step = None  # the layer loop for decode steps, as under tensor parallelism
    prompts = [{"prompt_token_ids": [(31 * i + j) % 8000 for j in range(PROMPT_LEN)]} for i in range(NUM_PROMPTS)]
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    llm.generate(prompts[:2], params, use_tqdm=False)  # warm-up
    before = CLOCK.total
    t0 = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    collective = CLOCK.total - before
    llm.shutdown()
    return {"tok_s": NUM_PROMPTS * NEW_TOKENS / seconds, "seconds": seconds, "collective_s": collective}


def run_memory(size: int) -> dict[str, list[float]]:
    from engine_core import LLM, SamplingParams

    llm = LLM(tensor_parallel_size=size, kv_cache_memory=0.05)
    llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    pids = [os.getpid()]
    if llm.engine.tensor_parallel is not None:
        pids += [p.pid for p in llm.engine.tensor_parallel.ranks.procs]
    out = {"rss_mb": [round(rss_mb(pid), 1) for pid in pids]}
    llm.shutdown()
    return out


def _allreduce_rank(rank: int, addr: str, out: object) -> None:
    import statistics

    import torch
    import torch.distributed as dist

    from engine_core.distributed.parallel_state import TensorParallel, form_group, leave_group

    torch.set_num_threads(1)
    form_group(TensorParallel(rank, 2), addr, torch.device("cpu"), "allreduce")
    x = torch.ones(16, 256)
    times = []
    for _ in range(2000):
        t0 = time.perf_counter()
        dist.all_reduce(x)
        times.append(time.perf_counter() - t0)
    if rank == 0:
        out.put(statistics.median(times))  # type: ignore[attr-defined]
    leave_group()


def run_allreduce() -> dict[str, float]:
    import multiprocessing as mp

    from engine_core.worker.rank_processes import free_loopback_addr

    ctx = mp.get_context("spawn")
    addr, out = free_loopback_addr(), ctx.Queue()
    procs = [ctx.Process(target=_allreduce_rank, args=(r, addr, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    median = out.get()
    for p in procs:
        p.join()
    return {"median_us": round(median * 1e6, 1)}


def child(args: argparse.Namespace) -> None:
    if args.mode == "cost":
        size, threads, native = ARMS[args.arm]
        print(json.dumps(run_arm(args.model, size, threads, native)))
    else:
        print(json.dumps(run_memory(args.size)))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=("cost", "memory", "allreduce"), default="cost")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--size", type=int, default=3)
    parser.add_argument("--arm", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    print(f"load average: {os.getloadavg()}")

    def fresh(*extra: str) -> dict:
        cmd = [sys.executable, __file__, "--child", "--mode", args.mode, *extra]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
        return json.loads(out.strip().splitlines()[-1])

    if args.mode == "allreduce":
        print(run_allreduce())
        print(f"load average: {os.getloadavg()}")
        return
    if args.mode == "memory":
        for size in (args.size, 1):
            print(f"TP={size}", fresh("--size", str(size)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        make_tiny(Path(tmp))
        for r in range(args.rounds):
            for arm in ARMS:
                print(f"round {r} {arm}", fresh("--arm", arm, "--model", tmp), flush=True)
    print(f"load average: {os.getloadavg()}")


if __name__ == "__main__":
    main()
