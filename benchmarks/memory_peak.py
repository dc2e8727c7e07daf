"""Where the offline benchmark's peak RSS comes from: the process's memory by category at its peak.

Runs what `side_by_side.py --engines pagoda --modes offline --workloads random` runs (an `LLM` with 2 threads and
2 GiB of KV cache, float32 unless told (`--dtype`, `--quantization`), the 2-request warm-up, then the 64-request
random workload through `LLM.generate`), in this process, while a thread samples its RSS (`/proc/self/statm`, every
`--interval` s). Each time the RSS passes its last breakdown by `--step-mb`, it reads `/proc/self/smaps` and sorts
every mapping's Rss:

- kv_cache: the KV cache's mapping (the runner's `PagedKvCache`), i.e. the pages faulted in so far;
- libraries: shared objects (torch, MKL/oneDNN, the native kernels, Python's extensions);
- files: other file-backed mappings (the model file while it is mapped);
- heap: `[heap]` (glibc's main arena: small and mid-sized mallocs, Python's objects);
- anon: other anonymous memory (malloc's mapped chunks and thread arenas, torch tensors above the mmap threshold,
  thread stacks).

It also sums the bytes of the model's resident tensors (weights in every form the layers keep) and reports
the breakdown after load, after warm-up, at the peak and at the end, with the peak's own `VmHWM`.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/memory_peak.py [--workloads random,prefix] [--kv-cache-gib 2]

Memory does not depend on the machine's load (time does): the breakdown is comparable across windows.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import threading
import time
from dataclasses import asdict, dataclass, field

import torch
from workload import make

PAGE = os.sysconf("SC_PAGE_SIZE")
MB = 1 << 20
_HEADER = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) \S+ \S+ \S+ \S+\s*(.*)$")


@dataclass
class Breakdown:
    label: str
    rss_mb: float
    kv_cache_mb: float = 0.0
    libraries_mb: float = 0.0
    files_mb: float = 0.0
    heap_mb: float = 0.0
    anon_mb: float = 0.0
    other_mb: float = 0.0
    heap_free_mb: float = 0.0  # free bytes inside malloc's arenas (mallinfo2's fordblks): resident unless trimmed


@dataclass
class Report:
    kv_cache_mapped_mb: float
    model_tensors_mb: float  # every tensor the model holds (weights in each form kept, tables), deduplicated
    vm_hwm_mb: float
    breakdowns: list[Breakdown] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def vm_hwm_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return 0.0


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks")
    ]


def heap_free_bytes() -> int:
    """Free bytes in glibc's arenas (0 where mallinfo2, glibc >= 2.33, is missing)."""
    fn = getattr(ctypes.CDLL(None), "mallinfo2", None)
    if fn is None:
        return 0
    fn.restype = _MallInfo2
    return int(fn().fordblks)


def breakdown(label: str, kv_range: tuple[int, int] | None) -> Breakdown:
    out = Breakdown(label, rss_mb=0.0, heap_free_mb=heap_free_bytes() / MB)
    start = end = 0
    name = ""
    with open("/proc/self/smaps") as f:
        for line in f:
            m = _HEADER.match(line)
            if m:
                start, end, name = int(m.group(1), 16), int(m.group(2), 16), m.group(3).strip()
                continue
            if not line.startswith("Rss:"):
                continue
            mb = int(line.split()[1]) / 1024
            out.rss_mb += mb
            if kv_range is not None and start < kv_range[1] and end > kv_range[0]:
                out.kv_cache_mb += mb
            elif name == "[heap]":
                out.heap_mb += mb
            elif ".so" in name:
                out.libraries_mb += mb
            elif name.startswith("/"):
                out.files_mb += mb
            elif name == "" or name.startswith("[anon"):
                out.anon_mb += mb
            else:  # [stack], [vdso], [vvar]
                out.other_mb += mb
    for k, v in asdict(out).items():
        if isinstance(v, float):
            setattr(out, k, round(v, 1))
    return out


def model_tensor_bytes(root: object) -> int:
    """Bytes of the distinct storages of every tensor reachable from `root`'s modules and their attributes."""
    seen_storages: set[int] = set()
    seen_objects: set[int] = set()
    total = 0
    stack = [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen_objects:
            continue
        seen_objects.add(id(obj))
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            if storage.data_ptr() not in seen_storages:
                seen_storages.add(storage.data_ptr())
                total += storage.nbytes()
        elif isinstance(obj, torch.nn.Module):
            stack.extend(obj._parameters.values())
            stack.extend(obj._buffers.values())
            stack.extend(obj._modules.values())
            stack.extend(v for k, v in vars(obj).items() if not k.startswith("_"))
        elif isinstance(obj, (list, tuple)):
            stack.extend(obj)
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif hasattr(obj, "__dataclass_fields__") or (
            hasattr(obj, "__dict__") and type(obj).__module__.startswith(("engine_core", "kernels"))
        ):
            stack.extend(vars(obj).values() if hasattr(obj, "__dict__") else ())
            stack.extend(getattr(obj, s) for s in getattr(type(obj), "__slots__", ()) if hasattr(obj, s))
    return total


class PeakSampler:
    """Samples RSS; takes a smaps breakdown whenever it passes the last one's by `step_mb`."""

    def __init__(self, kv_range: tuple[int, int] | None, interval: float, step_mb: float) -> None:
        self.kv_range, self.interval, self.step = kv_range, interval, step_mb * MB
        self.peak = 0
        self.max_used = 0  # most KV blocks in use at once (sampled)
        self.pool: object | None = None
        self.peak_breakdown: Breakdown | None = None
        self._taken_at = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            rss = rss_bytes()
            if self.pool is not None:
                self.max_used = max(self.max_used, self.pool.num_blocks - self.pool.num_free)
            self.peak = max(self.peak, rss)
            if rss >= self._taken_at + self.step:
                self.peak_breakdown = breakdown("peak", self.kv_range)
                self._taken_at = int(self.peak_breakdown.rss_mb * MB)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--workloads", default="random")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kv-cache-gib", type=float, default=2.0)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--quantization", default=None, help="e.g. int8 (vLLM's name; default: the checkpoint's own)")
    ap.add_argument("--interval", type=float, default=0.05, help="RSS sampling period, s")
    ap.add_argument("--step-mb", type=float, default=4.0, help="a new breakdown when RSS passes the last by this")
    ap.add_argument("--json", default=None, help="also write the report here")
    ap.add_argument("--worker-allocator", action="store_true", help="malloc as a worker sets it (retain_freed_memory)")
    ap.add_argument("--keep-load-heap", action="store_true", help="A/B: skip release_free_heap after the load")
    ap.add_argument("--no-heap-release", action="store_true", help="A/B: no HeapRelease after the large steps")
    ap.add_argument("--heap-release-tokens", type=int, default=None, help="A/B: HeapRelease's large_tokens")
    args = ap.parse_args()

    if args.worker_allocator:
        from engine_core.worker.host_allocator import retain_freed_memory

        retain_freed_memory()
    if args.keep_load_heap:
        import engine_core.worker.model_runner as model_runner

        model_runner.release_free_heap = lambda: False
    from engine_core import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(
        args.model,
        dtype=args.dtype,
        quantization=args.quantization,
        kv_cache_memory=args.kv_cache_gib,
        num_threads=args.threads,
    )
    seconds = {"load": time.perf_counter() - t0}
    runner = llm.engine.runner
    if args.no_heap_release:
        runner.heap_release = None
    elif args.heap_release_tokens is not None and runner.heap_release is not None:
        runner.heap_release.large_tokens = args.heap_release_tokens
    whole = runner.kv._whole
    kv_range = None
    if whole is not None:
        nbytes = whole.untyped_storage().nbytes()
        kv_range = (whole.data_ptr(), whole.data_ptr() + nbytes)
    report = Report(
        kv_cache_mapped_mb=round((kv_range[1] - kv_range[0]) / MB, 1) if kv_range else 0.0,
        model_tensors_mb=round(model_tensor_bytes(runner.model) / MB, 1),
        vm_hwm_mb=0.0,
    )
    report.breakdowns.append(breakdown("after load", kv_range))
    sampler = PeakSampler(kv_range, args.interval, args.step_mb)
    sampler.pool = llm.engine.core.scheduler.kv.pool

    def generate(prompts: list[list[int]], output_lens: list[int]) -> None:
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in output_lens]
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)

    warm = make("random", 2, seed=12345)
    generate(warm.prompts, [8, 8])
    report.breakdowns.append(breakdown("after warm-up", kv_range))
    for name in filter(None, args.workloads.split(",")):  # NOTE: --workloads "": the load and warm-up alone
        wl = make(name, args.num_requests, 0)
        t = time.perf_counter()
        generate(wl.prompts, wl.output_lens)
        seconds[name] = time.perf_counter() - t
        report.breakdowns.append(breakdown(f"after {name}", kv_range))
    sampler.stop()
    if sampler.peak_breakdown is not None:
        report.breakdowns.append(sampler.peak_breakdown)
    report.vm_hwm_mb = round(vm_hwm_mb(), 1)
    report.seconds = {k: round(v, 2) for k, v in seconds.items()}
    pool = sampler.pool
    print(
        f"KV cache mapped {report.kv_cache_mapped_mb} MB, model tensors {report.model_tensors_mb} MB, "
        f"VmHWM {report.vm_hwm_mb} MB, peak sampled {sampler.peak / MB:.1f} MB; seconds {report.seconds}"
    )
    if pool is not None:
        stats = llm.engine.core.scheduler.kv.stats
        hit = stats.hits / stats.queries if stats.queries else 0.0
        print(
            f"block pool: {pool.num_blocks} blocks, at most {sampler.max_used} in use at once, "
            f"evictions {pool.num_evictions}; prefix cache hits {stats.hits}/{stats.queries} tokens ({hit:.1%})"
        )
    if runner.heap_release is not None:
        print(f"heap releases after large steps: {runner.heap_release.releases}")
    walk = runner.kv.prefaulter
    if walk is not None:
        print(f"KV prefault walk: {walk.bytes_done / MB:.1f} MB of {walk.total_bytes / MB:.1f} MB populated")
    cols = [k for k in asdict(report.breakdowns[0]) if k != "label"]
    print(f"{'':16}" + "".join(f"{c:>14}" for c in cols))
    for b in report.breakdowns:
        print(f"{b.label:16}" + "".join(f"{getattr(b, c):>14.1f}" for c in cols))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(asdict(report), f)


if __name__ == "__main__":
    main()
