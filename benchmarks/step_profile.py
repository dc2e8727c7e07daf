"""Where a GPU step's time goes, per kind of step: host time to queue the forward vs the GPU's time for it.

Runs `LLM.generate` over gpu_check's scaled workload (random SmolLM2-shaped weights, bf16) and times every step:
- the forward's host time (queueing its kernels, or copying inputs and replaying a graph);
- the forward's span on the GPU (CUDA events around the step function; when the host is the bottleneck this span
  is about as long as the host time, since the GPU waits for each launch).
Then one recorded mixed step (decodes + prefill chunks) is run alone: eager (host time to queue, and wall time with
a sync), through the runner's mixed-step graphs (worker/mixed_graphs.py), and captured whole as one CUDA graph
of exactly its shape (its replay time is the GPU's floor for that step); and the host cost of single launches (a
Triton kernel, a torch GEMM, a graph replay) is timed.

    python benchmarks/step_profile.py --out DIR [--requests 1024] [--no-mixed-graphs]

Prints a summary and writes step_profile.json to DIR. Needs CUDA.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from kernels.triton_mode import configure_triton_interpret

configure_triton_interpret()

import torch

from engine_core.attention.backend import AttentionMetadata


def _clone_meta(meta: AttentionMetadata) -> AttentionMetadata:
    fields = {f.name: getattr(meta, f.name) for f in dataclasses.fields(meta)}
    return AttentionMetadata(**{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in fields.items()})


class StepRecorder:
    """Wraps the runner's step-function choice: events and host clocks around every forward."""

    def __init__(self, runner: object) -> None:
        import engine_core.worker.model_runner as mr

        self.runner = runner
        self.rows: list[dict[str, object]] = []
        self.sample: tuple[torch.Tensor, torch.Tensor, AttentionMetadata] | None = None
        self._pick = mr.pick_step_function
        mr.pick_step_function = self._wrapped_pick  # type: ignore[assignment]
        self._mr = mr

    def close(self) -> None:
        self._mr.pick_step_function = self._pick  # type: ignore[assignment]

    def _wrapped_pick(
        self, forward: object, decode_step: object, meta: AttentionMetadata, mixed_step: object = None
    ) -> object:
        step = self._pick(forward, decode_step, meta, mixed_step)  # type: ignore[arg-type]
        kind = "eager" if step is forward else "decode_graph" if step is decode_step else "mixed_graph"
        rows = self.rows

        def timed(ids: torch.Tensor, pos: torch.Tensor, kv: list[torch.Tensor], m: AttentionMetadata) -> torch.Tensor:
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            h0 = time.perf_counter()
            out = step(ids, pos, kv, m)  # type: ignore[operator]
            h1 = time.perf_counter()
            e1.record()
            rows.append(
                {
                    "kind": kind,
                    "tokens": m.num_tokens,
                    "decodes": m.num_decodes,
                    "prefills": m.num_prefills,
                    "host_ms": (h1 - h0) * 1000,
                    "events": (e0, e1),
                }
            )
            if m.num_prefills and m.num_decodes >= 64 and m.num_tokens >= 1024 and self.sample is None:
                self.sample = (ids.clone(), pos.clone(), _clone_meta(m))
            return out

        return timed

    def summary(self) -> dict[str, object]:
        torch.cuda.synchronize()
        for r in self.rows:
            e0, e1 = r.pop("events")  # type: ignore[misc]
            r["gpu_span_ms"] = e0.elapsed_time(e1)
        out: dict[str, object] = {}
        for kind in ("decode_graph", "mixed_graph", "eager"):
            rs = [r for r in self.rows if r["kind"] == kind]
            if not rs:
                continue
            out[kind] = {
                "steps": len(rs),
                "mean_tokens": statistics.mean(float(r["tokens"]) for r in rs),  # type: ignore[arg-type]
                "mean_host_ms": statistics.mean(float(r["host_ms"]) for r in rs),  # type: ignore[arg-type]
                "mean_gpu_span_ms": statistics.mean(float(r["gpu_span_ms"]) for r in rs),  # type: ignore[arg-type]
                "total_host_s": sum(float(r["host_ms"]) for r in rs) / 1000,  # type: ignore[arg-type]
            }
        return out


def _time_eager(forward: object, args: tuple[object, ...], reps: int) -> dict[str, float]:
    for _ in range(3):
        forward(*args)  # type: ignore[operator]
    torch.cuda.synchronize()
    host, wall = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        forward(*args)  # type: ignore[operator]
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        host.append((t1 - t0) * 1000)
        wall.append((time.perf_counter() - t0) * 1000)
    return {"host_queue_ms": statistics.median(host), "wall_ms": statistics.median(wall)}


def _time_graph(forward: object, args: tuple[object, ...], reps: int) -> dict[str, float]:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        forward(*args)  # type: ignore[operator]
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward(*args)  # type: ignore[operator]
    graph.replay()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(reps):
        graph.replay()
    e1.record()
    torch.cuda.synchronize()
    return {"gpu_ms": e0.elapsed_time(e1) / reps}


def _launch_costs() -> dict[str, float]:
    """Host microseconds per call, queued back to back (no sync inside the loop)."""
    from kernels.triton import rms_norm, silu_and_mul

    x = torch.randn(16, 576, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(576, device="cuda", dtype=torch.bfloat16)
    gu = torch.randn(16, 3072, device="cuda", dtype=torch.bfloat16)
    lin = torch.nn.Linear(576, 960, bias=False, device="cuda", dtype=torch.bfloat16)

    def per_call(fn: object, n: int = 2000) -> float:
        for _ in range(20):
            fn()  # type: ignore[operator]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()  # type: ignore[operator]
        dt = time.perf_counter() - t0
        torch.cuda.synchronize()
        return dt / n * 1e6

    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        rms_norm(x, w, 1e-5)
    with torch.inference_mode():
        return {
            "triton_rms_norm_us": per_call(lambda: rms_norm(x, w, 1e-5)),
            "triton_silu_and_mul_us": per_call(lambda: silu_and_mul(gu)),
            "torch_linear_us": per_call(lambda: lin(x)),
            "torch_empty_like_us": per_call(lambda: torch.empty_like(x)),
            "graph_replay_us": per_call(g.replay),
        }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="step_profile_out")
    ap.add_argument("--requests", type=int, default=1024)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--engine-args", default="{}", help="JSON of extra LLM(...) arguments")
    ap.add_argument("--no-mixed-graphs", action="store_true", help="steps with prefill chunks run eagerly")
    args = ap.parse_args(argv)
    import gpu_check
    from offline_throughput import make_workload

    from engine_core import LLM, SamplingParams

    model_dir = gpu_check.build_random_model(Path(tempfile.mkdtemp(prefix="step_profile_")), gpu_check.SMOLLM2_SHAPES)
    wl = make_workload(args.requests, 1, 49152, (64, 512), (32, 256))
    llm = LLM(
        str(model_dir),
        device="cuda",
        dtype="bfloat16",
        max_num_seqs=256,
        max_num_batched_tokens=args.max_num_batched_tokens,
        **json.loads(args.engine_args),
    )
    runner = llm.engine.runner
    if args.no_mixed_graphs:
        runner.mixed_step = None  # the before of a before/after (see offline_throughput.run_pagoda)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in wl.output_lens]
    prompts = [{"prompt_token_ids": p} for p in wl.prompts]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)
    rec = StepRecorder(runner)
    t0 = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    rec.close()
    result: dict[str, object] = {
        "requests": args.requests,
        "seconds": seconds,
        "total_tok_s": wl.total_tokens / seconds,
        "steps": rec.summary(),
    }
    if rec.sample is not None:
        ids, pos, meta = rec.sample
        fwd_args = (ids, pos, runner.kv_caches, meta)
        with torch.inference_mode():
            runner.backend.prepare(meta)
            one = {
                "tokens": meta.num_tokens,
                "decodes": meta.num_decodes,
                "prefills": meta.num_prefills,
                "eager": _time_eager(runner.model, fwd_args, 20),
                "whole_graph": _time_graph(runner.model, fwd_args, 20),
            }
            if runner.mixed_step is not None:
                one["mixed_graph_step"] = _time_eager(runner.mixed_step, fwd_args, 20)
        result["one_mixed_step"] = one
    result["launch_host_us"] = _launch_costs()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"step_profile{'_eager_mixed' if args.no_mixed_graphs else ''}.json").write_text(
        json.dumps(result, indent=2)
    )
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
