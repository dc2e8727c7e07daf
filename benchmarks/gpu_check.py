"""`make gpu-check`: what the first session with a GPU runs, in one device call, with every result written as JSON.

Sections, in order (each is recorded as ok / fail / skipped with its numbers; a failing section does not stop the
ones after it, and the JSON file is rewritten after each, so a run cut short still returns what it measured):

1. `environment`  versions and the device; on CUDA asserts the Triton kernels are compiled, not interpreted.
2. `variants`     a decode growing from 1 to 4096 tokens adds no compiled variants after the first two (counts the
                  kernels' own caches: this is what the CPU tests can only model).
3. `greedy`       a random-weight model with SmolLM2-135M's shapes: greedy tokens of the Triton backend == torch
                  backend == transformers in float32, CUDA-graph decode == eager (asserted); in bfloat16, each
                  implementation's per-position top-1 agreement with float32 (reported, transformers' own beside).
3a. `spec_decode` greedy with ngram / suffix speculation == without (float32, CUDA graphs; asserted), acceptance,
                  batch-1 ms per token on / off (benchmarks/gpu_features.py).
3a. `features`    sampling controls, logprobs, structured outputs and beam search through the CUDA graphs, each
                  asserting what it promises (allowed tokens, a grammar, a seed's determinism, width 1 == greedy).
3b. `tensor_parallel` with two GPUs or more: greedy tokens of `tensor_parallel_size=2` (NCCL, one GPU per rank,
                  CUDA-graph decode with the all-reduces captured) == one GPU, in float32 (asserted); skipped, and
                  says so, with fewer GPUs or in a dry run.
4. `kernel_bench` `benchmarks/kernels_bench.py` at SmolLM2 and Llama-3-8B attention shapes: decode as a fraction of
                  the HBM peak, prefill TFLOP/s, both against SDPA.
5. `throughput`   `benchmarks/offline_throughput.py`'s workload, Pagoda vs transformers (`generate`, and a plain
                  forward loop at batch 1), on the same GPU, bf16; then Pagoda alone on `--scale-requests`.
6. `host_profile` cProfile of that scaled run: where the host's time goes between kernels.
6b. `quantized`  the CUDA linears on int8 codes (benchmarks/gpu_check_quantized.py): the coded Triton GEMM against its
                  reference and `F.linear` at SmolLM2 / Llama-3-8B linear shapes (error, ms, GB/s at M = 1); a GGUF
                  file of the random model in Q8_0 ... Q5_1: float32 greedy tokens == transformers' (asserted);
                  `quantization="int8"`: top-1 agreement with float32, batch-1 ms/token int8 vs bf16 vs GGUF.
7. `kernel_tests` `pytest tests/kernels` on the device (CUDA tensors, fp32 / bf16 / fp16 against the torch
                  references), in a subprocess; last, because compiling its ~100 variants takes the longest.

It needs only what the device image has (torch, triton, transformers, pytest) plus structlog, which travels as a
wheel (`make gpu-wheels`, then carry `.whl`; recipe in docs/kernels.md). No weights, no tokenizer files, no network:
the model and a word-level tokenizer are generated here.

    python benchmarks/gpu_check.py --out DIR [--budget-s 540]
    python benchmarks/gpu_check.py --dry-run --out DIR    # CPU, Triton interpreter, tiny shapes: wiring only
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# NOTE: the benchmark scripts import their siblings (`workload`) as top-level modules, as when run as scripts.
sys.path.insert(0, str(ROOT / "benchmarks"))

# NOTE: the one interpreter-or-compiled decision, before anything (transformers) imports triton.
from kernels.triton_mode import configure_triton_interpret

INTERPRETED = configure_triton_interpret()

import gpu_features
import torch
from gpu_features import free_gpu_memory

# SmolLM2-135M's architecture (config.json of HuggingFaceTB/SmolLM2-135M-Instruct), with random weights.
SMOLLM2_SHAPES = {
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "max_position_embeddings": 8192,
    "rope_theta": 100000.0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
}
# --dry-run: the same code paths at a size the interpreter gets through in seconds.
TINY_SHAPES = SMOLLM2_SHAPES | {"hidden_size": 144, "intermediate_size": 128, "num_hidden_layers": 2, "head_dim": 16}
# NOTE: a wide weight init makes the logits peaky, so argmax is decided by the model, not by rounding noise (the
# greedy comparison of two correct implementations would otherwise flip on near-ties).
INIT_RANGE = 0.2


@dataclass
class Check:
    """Shared by the sections: where results go, the device, and the time left."""

    out_dir: Path
    dry_run: bool
    deadline: float
    device: str = "cuda"
    scale_requests: int = 0
    scale_batched_tokens: tuple[int, ...] = (2048,)
    results: dict[str, dict[str, object]] = field(default_factory=dict)
    _model_dir: Path | None = None

    @property
    def shapes(self) -> dict[str, object]:
        return TINY_SHAPES if self.dry_run else SMOLLM2_SHAPES

    @property
    def dtype(self) -> str:
        """The throughput runs' dtype: bf16 on a GPU; fp32 in a dry run (the interpreter's dots are fp32)."""
        return "float32" if self.dry_run else "bfloat16"

    def workload(self, n: int, seed: int) -> object:
        """`offline_throughput`'s workload shape (prompts 64-512, outputs 32-256; tiny in a dry run)."""
        ranges = ((4, 12), (2, 5)) if self.dry_run else ((64, 512), (32, 256))
        vocab = int(self.shapes["vocab_size"])  # type: ignore[call-overload]
        return importlib.import_module("offline_throughput").make_workload(n, seed, vocab, *ranges)

    def time_left(self) -> float:
        return self.deadline - time.monotonic()

    def model_dir(self) -> Path:
        if self._model_dir is None:
            self._model_dir = build_random_model(Path(tempfile.mkdtemp(prefix="gpu_check_model_")), self.shapes)
        return self._model_dir

    def write(self) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        (self.out_dir / "gpu_check.json").write_text(json.dumps(self.results, indent=2, default=str))


def build_random_model(path: Path, shapes: dict[str, object]) -> Path:
    """A seeded random-weight Llama with `shapes`, and a word-level tokenizer over its vocabulary: `<unk>` (0), the
    256 byte-level characters (1-256), then `t257` ... `tN` (text is the names joined, without spaces)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

    # NOTE: EOS is the tokenizer's last token in config.json too (LlamaConfig's default is 2), so the engine's stop
    # and a grammar's end agree.
    vocab_size = int(shapes["vocab_size"])  # type: ignore[call-overload]
    config = LlamaConfig(**shapes, initializer_range=INIT_RANGE, eos_token_id=vocab_size - 1)
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    # NOTE: the structured-output backend (llguidance) reads each token's bytes through a byte-level decoder and
    # needs every single byte to be a token; then any grammar whose forced text is one token at a time works.
    vocab = {"<unk>": 0} | {ch: 1 + i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab |= {f"t{i}": i for i in range(len(vocab), vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.ByteLevel()
    eos = f"t{vocab_size - 1}"
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token=eos).save_pretrained(path)
    return path


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


# ---- sections ------------------------------------------------------------------------------------------------------
def section_environment(c: Check) -> dict[str, object]:
    import transformers
    import triton

    info: dict[str, object] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "transformers": transformers.__version__,
        "cuda_available": torch.cuda.is_available(),
        "triton_interpreted": INTERPRETED,
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info |= {"device": props.name, "sms": props.multi_processor_count, "memory_gib": props.total_memory / 2**30}
    kernels = _triton_kernels()
    info["kernel_classes"] = sorted({type(k).__name__ for k in kernels.values()})
    if not c.dry_run:
        from triton.runtime.interpreter import InterpretedFunction

        assert torch.cuda.is_available(), "no CUDA device visible (run with --dry-run to check the wiring on CPU)"
        assert not INTERPRETED, "TRITON_INTERPRET is on: the kernels would be interpreted on a GPU machine"
        bad = [name for name, k in kernels.items() if isinstance(k, InterpretedFunction)]
        assert not bad, f"interpreted kernels on a GPU: {bad}"
    return info


def _triton_kernels() -> dict[str, object]:
    mods = ["decode_attention", "prefill_attention", "store_kv", "fused", "coded_matmul"]
    found = {}
    for m in mods:
        module = importlib.import_module(f"kernels.triton.{m}")
        found |= {f"{m}.{k}": v for k, v in vars(module).items() if k.startswith("_") and k.endswith("_kernel")}
    return found


_MODE_TEST = "test_triton_mode.py::test_device_follows_the_one_decision"


_DEFAULT_MODEL_TEST = "test_coded_linear.py::test_the_default_models_projections_all_have_codes"


def section_kernel_tests(c: Check) -> dict[str, object]:
    cmd = [sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider"]
    if c.dry_run:  # two cheap tests prove the subprocess wiring
        cmd += [f"tests/kernels/{t}" for t in ("test_store_kv.py::test_store_kv_all_skipped_and_empty", _MODE_TEST)]
    else:
        # NOTE: that test reads the packaged default model, which the device image lacks (no registry there).
        cmd += ["tests/kernels", "--deselect", f"tests/kernels/{_DEFAULT_MODEL_TEST}"]
    if not c.dry_run and importlib.util.find_spec("xdist") is not None:
        cmd += ["-n", "8"]  # compiling the variants is the slow part, and it is CPU work: spread it
    timeout = max(30.0, c.time_left() - 15)
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    # NOTE: the whole log comes back beside the JSON; the JSON keeps what failed (a crashed xdist worker prints
    # its test and stack in stderr, where a tail would lose it under the worker's traceback).
    (c.out_dir / "kernel_tests.log").write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    lines = (proc.stdout + "\n" + proc.stderr).splitlines()
    summary = next((ln for ln in reversed(proc.stdout.splitlines()) if " passed" in ln or " failed" in ln), "")
    failures = [ln for ln in lines if ln.startswith(("FAILED", "ERROR")) or "crashed" in ln or "Fatal Python" in ln]
    result = {
        "returncode": proc.returncode,
        "summary": summary,
        "failures": failures[:40],
        "pytest_seconds": round(time.monotonic() - t0, 1),
        "tail": (proc.stdout + proc.stderr)[-2000:],
    }
    assert proc.returncode == 0, f"kernel tests failed: {summary}; {failures[:40]}"
    return result


def section_variants(c: Check) -> dict[str, object]:
    """Compiled-variant counts of the decode kernels while one batch's context grows (the real triton caches)."""
    from kernels.triton import decode_attention

    mod = importlib.import_module("kernels.triton.decode_attention")
    if INTERPRETED:
        return {"skipped": "interpreter has no compile cache; tests/kernels/test_no_recompiles.py models it"}

    def cached(kernel: object) -> int:
        caches = kernel.device_caches[torch.cuda.current_device()]  # type: ignore[attr-defined]
        return len(caches[0])  # (kernel_cache, ...): one entry per compiled variant

    heads, kv_heads, head_dim, block = 9, 3, 64, 16
    max_len = 4096
    num_blocks = max_len // block
    kv = torch.randn(2, num_blocks, block, kv_heads, head_dim, dtype=torch.bfloat16, device="cuda")
    table = torch.randperm(num_blocks, device="cuda", dtype=torch.int32)[None]
    q = torch.randn(1, heads, head_dim, dtype=torch.bfloat16, device="cuda")
    before = (cached(mod._decode_kernel), cached(mod._decode_reduce_kernel))
    splits = set()
    for n in range(1, max_len + 1, 7):
        width = -(-n // block)
        lens = torch.tensor([n], dtype=torch.int32, device="cuda")
        splits.add(mod.choose_num_splits(1, kv_heads, n, torch.cuda.get_device_properties(0).multi_processor_count))
        decode_attention(q, kv[0], kv[1], table[:, :width], lens, 0.125, n)
    _sync()
    after = (cached(mod._decode_kernel), cached(mod._decode_reduce_kernel))
    new = (after[0] - before[0], after[1] - before[1])
    result = {"split_counts_seen": sorted(splits), "new_decode_variants": new[0], "new_reduce_variants": new[1]}
    assert new[0] <= 2 and new[1] <= 1, f"decode recompiled while the sequence grew: {result}"
    return result


def _greedy_pagoda(
    model_dir: Path,
    device: str,
    backend: str,
    dtype: str,
    prompts: list[list[int]],
    n: int,
    enforce_eager: bool = False,
    tensor_parallel_size: int = 1,
) -> list[list[int]]:
    from engine_core import LLM, SamplingParams

    llm = LLM(
        str(model_dir),
        tensor_parallel_size=tensor_parallel_size,
        device=device,
        attention_backend=backend,
        dtype=dtype,
        num_kv_blocks=512,
        max_num_batched_tokens=256,
        max_num_seqs=16,
        enforce_eager=enforce_eager,
    )
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    llm.shutdown()
    del llm
    free_gpu_memory()
    return [o.outputs[0].token_ids for o in outs]


def _greedy_hf(model_dir: Path, device: str, prompts: list[list[int]], n: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    result = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p], device=device)
            out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
            result.append(out[0, len(p) :].tolist())
    del model
    free_gpu_memory()
    return result


def _top1_pagoda(model_dir: Path, device: str, backend: str, dtype: str, prompts: list[list[int]]) -> list[int]:
    """The most likely next token at every prompt position after the first (teacher-forced, `prompt_logprobs`)."""
    from engine_core import LLM, SamplingParams

    llm = LLM(str(model_dir), device=device, attention_backend=backend, dtype=dtype, num_kv_blocks=512)
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    del llm
    free_gpu_memory()
    return [next(t for t, lp in pos.items() if lp.rank == 1) for o in outs for pos in (o.prompt_logprobs or []) if pos]


def _top1_hf(model_dir: Path, device: str, dtype: str, prompts: list[list[int]]) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(device).eval()
    with torch.no_grad():
        top = [model(torch.tensor([p], device=device)).logits[0, :-1].argmax(-1).tolist() for p in prompts]
    del model
    free_gpu_memory()
    return [t for row in top for t in row]


def _bf16_top1_agreement(model_dir: Path, device: str, prompts: list[list[int]]) -> dict[str, float]:
    """How often each bf16 implementation's most likely token matches float32's, over every prompt position.

    NOTE: greedy streams of two correct bf16 implementations part at the first near-tie and never meet again, so
    their agreement length says little; per-position top-1 agreement with float32, beside transformers' own bf16
    figure, says whether the Triton path loses more precision than bf16 itself does.
    """
    ref = _top1_hf(model_dir, device, "float32", prompts)
    runs = {
        "transformers": _top1_hf(model_dir, device, "bfloat16", prompts),
        "pagoda_triton": _top1_pagoda(model_dir, device, "triton", "bfloat16", prompts),
        "pagoda_torch": _top1_pagoda(model_dir, device, "torch", "bfloat16", prompts),
        "pagoda_triton_float32": _top1_pagoda(model_dir, device, "triton", "float32", prompts),
    }
    for name, top in runs.items():
        assert len(top) == len(ref), (name, len(top), len(ref))
    return {name: sum(a == b for a, b in zip(top, ref, strict=True)) / len(ref) for name, top in runs.items()}


def section_greedy(c: Check) -> dict[str, object]:
    model_dir = c.model_dir()
    gen = torch.Generator().manual_seed(1)
    vocab = int(c.shapes["vocab_size"])  # type: ignore[call-overload]
    lengths = (1, 7, 17, 40) if c.dry_run else (1, 7, 16, 17, 40, 70, 300, 600)
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]
    n = 4 if c.dry_run else 32
    hf = _greedy_hf(model_dir, c.device, prompts, n)
    fp32 = {b: _greedy_pagoda(model_dir, c.device, b, "float32", prompts, n) for b in ("triton", "torch")}
    result: dict[str, object] = {
        "prompt_lengths": list(lengths),
        "new_tokens": n,
        "float32_triton_eq_torch_eq_transformers": fp32["triton"] == fp32["torch"] == hf,
    }
    if not c.dry_run:  # decode steps as CUDA graphs (the default above) vs every kernel launched eagerly
        eager = _greedy_pagoda(model_dir, c.device, "triton", "float32", prompts, n, enforce_eager=True)
        result["float32_cuda_graphs_eq_eager"] = eager == fp32["triton"]
    if not c.dry_run:  # bf16 agreement is a measurement: two correct bf16 implementations may part after a while
        bf16 = {b: _greedy_pagoda(model_dir, c.device, b, "bfloat16", prompts, n) for b in ("triton", "torch")}
        agree = [
            next((i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), n)
            for x, y in zip(bf16["triton"], bf16["torch"], strict=True)
        ]
        result["bfloat16_triton_vs_torch_tokens_agreeing_per_prompt"] = agree
    result["bfloat16_top1_agreement_with_float32"] = _bf16_top1_agreement(model_dir, c.device, prompts)
    assert result["float32_triton_eq_torch_eq_transformers"], {"hf": hf, **fp32}
    assert result.get("float32_cuda_graphs_eq_eager", True), "CUDA-graph decode steps changed the tokens"
    return result


def section_spec_decode(c: Check) -> dict[str, object]:
    vocab = int(c.shapes["vocab_size"])  # type: ignore[call-overload]
    return gpu_features.spec_decode_check(c.model_dir(), c.device, c.dry_run, vocab)


def section_features(c: Check) -> dict[str, object]:
    vocab = int(c.shapes["vocab_size"])  # type: ignore[call-overload]
    return gpu_features.features_check(c.model_dir(), c.device, c.dry_run, vocab)


def section_tensor_parallel(c: Check) -> dict[str, object]:
    gpus = torch.cuda.device_count()
    if c.dry_run or gpus < 2:
        return {"skipped": f"tensor parallelism needs 2 GPUs; this machine has {gpus}" + (" (dry run)" * c.dry_run)}
    model_dir = c.model_dir()
    gen = torch.Generator().manual_seed(2)
    vocab = int(c.shapes["vocab_size"])  # type: ignore[call-overload]
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (1, 17, 70, 300)]
    one = _greedy_pagoda(model_dir, c.device, "triton", "float32", prompts, 32)
    two = _greedy_pagoda(model_dir, c.device, "triton", "float32", prompts, 32, tensor_parallel_size=2)
    result: dict[str, object] = {"gpus": gpus, "float32_tp2_eq_tp1": two == one}
    assert result["float32_tp2_eq_tp1"], {"tp1": one, "tp2": two}
    return result


def section_kernel_bench(c: Check) -> dict[str, object]:
    bench = importlib.import_module("kernels_bench")
    name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu (dry run)"
    peak = bench.hbm_peak_gbs(name)
    torch.manual_seed(0)
    result: dict[str, object] = {"device": name, "hbm_peak_gbs": peak}
    for key in ("smollm2", "llama8b"):
        shape = bench.SHAPES[key]
        if c.dry_run:
            decode = bench.bench_decode(shape, 16, peak, batches=(2,), contexts=(40,), device=c.device)
            prefill = bench.bench_prefill(shape, 16, cases=((1, 8, 16),), device=c.device)
        else:
            decode = bench.bench_decode(shape, 16, peak, device=c.device)
            prefill = bench.bench_prefill(shape, 16, device=c.device)
        best = max(r["pct_peak"] for r in decode)
        result[key] = {"decode": decode, "prefill": prefill, "best_decode_pct_of_hbm_peak": best}
    return result


def section_throughput(c: Check) -> dict[str, object]:
    bench = importlib.import_module("offline_throughput")
    dtype = c.dtype
    args = argparse.Namespace(
        model=str(c.model_dir()),
        kv_cache_memory=1.0,
        max_num_seqs=64,
        max_num_batched_tokens=2048,
        hf_batch=16,
        batch1_prompt=16 if c.dry_run else 128,
        batch1_tokens=4 if c.dry_run else 128,
        device=c.device,
        dtype=dtype,
    )
    wl = c.workload(3 if c.dry_run else 64, 0)
    pagoda, _ = bench.run_pagoda(wl, args)
    free_gpu_memory()
    # NOTE: before/after of the mixed-step CUDA graphs (engine_core/worker/mixed_graphs.py) in the same run: steps with
    # prefill chunks launched eagerly, decode-only steps still graphs ("before" in docs/benchmarks.md, "GPU (H100)").
    eager_mixed, _ = bench.run_pagoda(wl, argparse.Namespace(**(vars(args) | {"mixed_graphs": False})))
    free_gpu_memory()
    hf = bench.run_hf(wl, args, str(c.model_dir()))
    free_gpu_memory()
    prompt = bench.batch1_prompt(args.batch1_prompt)
    loop_ms = _hf_forward_loop_ms(c.model_dir(), c.device, dtype, prompt, args.batch1_tokens)
    result: dict[str, object] = {
        "dtype": dtype,
        "requests": len(wl.prompts),
        "total_tokens": wl.total_tokens,
        "pagoda": vars(pagoda),
        "pagoda_eager_mixed_steps": vars(eager_mixed),
        "transformers": vars(hf),
        "transformers_forward_loop_batch1_ms_per_token": loop_ms,
        "ratio_total_tok_s": pagoda.total_tok_s / hf.total_tok_s,
    }
    # NOTE: 64 requests finish in about a second on a GPU; the same workload shape at `--scale-requests`, Pagoda
    # alone with its own defaults (KV cache sized from free memory), is what a loaded machine does.
    if c.scale_requests:
        big = c.workload(c.scale_requests, 1)
        for tokens in c.scale_batched_tokens:
            scaled_args = argparse.Namespace(**(vars(args) | {"max_num_seqs": 256, "max_num_batched_tokens": tokens}))
            for name, mixed in (
                (f"pagoda_scaled_{tokens}", True),
                (f"pagoda_scaled_{tokens}_eager_mixed_steps", False),
            ):
                scaled, _ = bench.run_pagoda(big, argparse.Namespace(**(vars(scaled_args) | {"mixed_graphs": mixed})))
                free_gpu_memory()
                result[name] = {
                    "requests": c.scale_requests,
                    "max_num_seqs": 256,
                    "max_num_batched_tokens": tokens,
                    **vars(scaled),
                }
    return result


def _hf_forward_loop_ms(model_dir: Path, device: str, dtype: str, prompt: list[int], n: int) -> float:
    """Batch-1 greedy decode as a plain loop over transformers' forward with its KV cache (no `generate`): the
    model's own per-token cost on this device, beside what `generate` adds."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(device).eval()
    ids = torch.tensor([prompt], device=device)
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
        past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        _sync()
        t0 = time.perf_counter()
        for _ in range(n):
            out = model(input_ids=token, past_key_values=past, use_cache=True)
            past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        _sync()
    ms = (time.perf_counter() - t0) / n * 1000
    del model, past
    free_gpu_memory()
    return ms


def section_quantized(c: Check) -> dict[str, object]:
    """Its sub-checks each record their numbers or error (gpu_check_quantized.py); `failed_checks` fails the section."""
    return importlib.import_module("gpu_check_quantized").run(c)


def section_host_profile(c: Check) -> dict[str, object]:
    """cProfile of `LLM.generate` over the scaled workload: what the host does per step while the GPU computes
    (on a GPU a small model's steps are bound by the host, not by the kernels)."""
    import cProfile
    import io
    import pstats

    from engine_core import LLM, SamplingParams

    wl = c.workload(c.scale_requests or 64, 1)
    llm = LLM(str(c.model_dir()), device=c.device, dtype=c.dtype, max_num_seqs=256, kv_cache_memory=8.0)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in wl.output_lens]
    prompts = [{"prompt_token_ids": p} for p in wl.prompts]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)
    profiler = cProfile.Profile()
    t0 = time.perf_counter()
    profiler.enable()
    llm.generate(prompts, params, use_tqdm=False)
    profiler.disable()
    seconds = time.perf_counter() - t0
    del llm
    free_gpu_memory()
    tables = {}
    for order in ("tottime", "cumulative"):
        buf = io.StringIO()
        pstats.Stats(profiler, stream=buf).sort_stats(order).print_stats(30)
        tables[order] = buf.getvalue()[-6000:]
    print(tables["tottime"])
    return {"requests": len(wl.prompts), "seconds_profiled": seconds, "top_by": tables}


# Section name, function, seconds it needs at least (on a GPU) to be worth starting.
# NOTE: the kernel tests run last: they compile ~100 kernel variants (minutes), and greedy equality and the
# benchmark's own SDPA checks already exercise every kernel, so they are what a short budget keeps.
SECTIONS: list[tuple[str, Callable[[Check], dict[str, object]], float]] = [
    ("environment", section_environment, 0),
    ("variants", section_variants, 20),
    ("greedy", section_greedy, 60),
    ("spec_decode", section_spec_decode, 40),
    ("features", section_features, 30),
    ("tensor_parallel", section_tensor_parallel, 60),
    ("kernel_bench", section_kernel_bench, 90),
    ("throughput", section_throughput, 90),
    ("host_profile", section_host_profile, 60),
    ("quantized", section_quantized, 120),
    ("kernel_tests", section_kernel_tests, 60),
]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT") or "gpu_check_out", help="folder for gpu_check.json")
    ap.add_argument("--budget-s", type=float, default=540.0, help="stop starting sections after this many seconds")
    ap.add_argument("--dry-run", action="store_true", help="CPU + Triton interpreter, tiny shapes: wiring only")
    ap.add_argument("--only", default=None, help="comma list of sections to run (default: all)")
    ap.add_argument("--scale-requests", type=int, default=1024, help="throughput: Pagoda alone on this many requests")
    ap.add_argument("--scale-batched-tokens", default="2048,8192", help="max_num_batched_tokens of those runs")
    args = ap.parse_args(argv)
    if importlib.util.find_spec("structlog") is None:
        sys.exit("structlog is missing: run `make gpu-wheels` here and carry .whl (docs/kernels.md, GPU check)")
    check = Check(
        out_dir=Path(args.out),
        dry_run=args.dry_run,
        deadline=time.monotonic() + args.budget_s,
        device="cpu" if args.dry_run else "cuda",
        scale_requests=4 if args.dry_run else args.scale_requests,
        scale_batched_tokens=tuple(int(t) for t in args.scale_batched_tokens.split(",")),
    )
    wanted = set(args.only.split(",")) if args.only else {name for name, _, _ in SECTIONS}
    failed = []
    for name, fn, needs in SECTIONS:
        if name not in wanted:
            continue
        if not args.dry_run and check.time_left() < needs:
            check.results[name] = {"status": "skipped", "reason": f"{check.time_left():.0f} s left, needs {needs}"}
            check.write()
            continue
        print(f"== {name}", flush=True)
        t0 = time.monotonic()
        try:
            res = fn(check)
            status = "skipped" if "skipped" in res else "fail" if res.get("failed_checks") else "ok"
            if status == "fail":
                failed.append(name)
        except Exception as e:  # a failed section is recorded and the next one still runs
            res = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
            status = "fail"
            failed.append(name)
        check.results[name] = {"status": status, "seconds": round(time.monotonic() - t0, 1), **res}
        check.write()
        print(f"   {status} in {check.results[name]['seconds']} s", flush=True)
    print(f"wrote {check.out_dir / 'gpu_check.json'}; failed: {failed or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
