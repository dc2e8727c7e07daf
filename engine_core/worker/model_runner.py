"""The model runner: executes a `SchedulerOutput` on the model and the paged KV cache, returns sampled tokens.

It is what a worker process runs. It keeps the persistent batch (`InputBatch` + `SamplingBatch`) in sync from the
plan's deltas alone, so the scheduler never sends token ids for decode steps.
"""

from __future__ import annotations

import math
import time

import numpy as np
import structlog
import torch

from engine_core.attention.selector import create_backend
from engine_core.checkpoint.model_dir import gguf_file
from engine_core.checkpoint.model_files import resolve_model_dir
from engine_core.config import EngineConfig
from engine_core.distributed import collectives
from engine_core.distributed.parallel_state import TensorParallel, kv_heads_per_rank
from engine_core.model.layers.cpu_gemm_rows import CpuGemmRows, can_pack
from engine_core.model.layers.layer_ops import select_layer_ops
from engine_core.model.layers.linear import process_linear_weights
from engine_core.model.layers.selector import select_linear_method
from engine_core.model.llama import model_class
from engine_core.model.loader import DTYPES, architecture, iter_weights, load_config, prefetch_weights
from engine_core.model.native_decode import NativeDecodeStep
from engine_core.model.quantization import resolve_weight_format
from engine_core.plan import ModelRunnerOutput, SchedulerOutput
from engine_core.sample.sampler import FAILED_TOKEN, Sampler
from engine_core.sample.sampling_batch import SamplingBatch
from engine_core.step_timings import StepTimings
from engine_core.structured_output.guidance import backend_for_model
from engine_core.worker.attention_inputs import attention_metadata
from engine_core.worker.beam_rows import apply_beam_deltas
from engine_core.worker.device_inputs import DeviceInputs, step_input_specs
from engine_core.worker.draft_model import DraftModel
from engine_core.worker.draft_runner import DraftRunner
from engine_core.worker.driver_sampling import sample_on_driver
from engine_core.worker.graph_steps import capture_graphs, cuda_graph_steps
from engine_core.worker.head_step import fused_head
from engine_core.worker.host_allocator import HeapRelease, release_free_heap
from engine_core.worker.input_batch import InputBatch
from engine_core.worker.kv_prefault import highest_new_block
from engine_core.worker.model_setup import (
    GIB,
    ModelInfo,
    dtype_name,
    resolve_max_model_len,
    runner_dtypes,
    set_cpu_threads,
)
from engine_core.worker.paged_kv_cache import PagedKvCache
from engine_core.worker.pending_grammars import IDLE_WAIT_S, PendingGrammars
from engine_core.worker.prompt_logprobs import prompt_logprobs
from engine_core.worker.spec_verify import Verification, write_drafts
from engine_core.worker.step_functions import StepFunction, pick_step_function
from engine_core.worker.step_sampling import batch_metadata, picked_step, sample_step
from engine_core.worker.verified_output import emit_verified
from engine_core.worker.verify_rows import as_decode_rows
from kernels import cpu as cpu_kernels
from kernels.triton_mode import configure_triton_interpret

# NOTE: the engine's entry into the kernels: decide interpreted-or-compiled before anything (a transformers forward,
# torch.compile) can import triton; the Triton backend and fused ops import their kernels only when chosen. Not
# strict: where the caller imported triton first, only choosing the Triton backend on a CUDA-less machine fails.
configure_triton_interpret(strict=False)

log = structlog.get_logger(__name__)


class ModelRunner:
    def __init__(
        self, config: EngineConfig, model_dir: str, gemm_rows: CpuGemmRows | None = None, rank: int = 0
    ) -> None:
        """`gemm_rows`: the CPU float32 GEMM dispatch's row thresholds (tests move them); None: this CPU's.
        `rank`: which of the config's `tensor_parallel_size` shards this runner holds (engine_core/distributed)."""
        self.config = config
        self.tp = TensorParallel(rank, config.tensor_parallel_size)
        self.device = torch.device(config.device)
        if self.device.type == "cuda" and self.device.index is None and self.tp.size > 1:
            self.device = torch.device("cuda", rank)  # NOTE: one GPU per rank, as NCCL needs
        self.dtype, self.gemm_dtype = runner_dtypes(config, self.device)
        if self.device.type == "cpu":
            set_cpu_threads(config, self.tp)
        if config.quantization in ("gguf", "gguf_a8") and gguf_file(model_dir) is None:
            raise ValueError(
                f"quantization={config.quantization!r} needs a .gguf model; {config.model or model_dir} has none"
            )
        weight_format = resolve_weight_format(config.quantization, model_dir, self.device)
        prefetch_weights(model_dir)  # the disk read overlaps the config import and the model's construction
        hf = load_config(model_dir)
        self.hf_config = hf
        arch = architecture(hf)
        cls = model_class(arch)
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        self.max_model_len = resolve_max_model_len(config, hf)
        num_kv_heads = kv_heads_per_rank(hf.num_key_value_heads, self.tp.size)  # this rank's, in its KV cache
        backend = create_backend(
            config.resolved_backend,
            hf.num_attention_heads // self.tp.size,
            num_kv_heads,
            head_dim,
            config.block_size,
            head_dim**-0.5,
            self.dtype,
        )
        self.backend = backend
        # an unsupported kv_cache_dtype fails here, before the weights load
        self.kv_dtype = DTYPES[
            config.resolved_kv_cache_dtype(dtype_name(self.dtype), dtype_name(self.gemm_dtype), backend.cache_dtypes)
        ]
        t0 = time.perf_counter()
        with torch.device(self.device):
            model = cls(hf, backend, self.max_model_len, self.tp)
        # NOTE: the CUDA linears take every GGUF format's codes from the file (layers/cuda_codes.py); the CPU ones find
        # the legacy formats' codes from the float32 weight themselves.
        cuda = self.device.type == "cuda"
        model.load_weights(weight_format.weights(iter_weights(model_dir, hf, with_codes=True, legacy_codes=cuda)))
        self.model = model.to(dtype=self.dtype).eval()
        # NOTE: after the dtype cast: each linear's method keeps its weight in the form(s) its kernels read, once.
        linear_method = select_linear_method(
            self.device, self.dtype, gemm_rows, self.gemm_dtype, weight_format.int8, weight_format.a8
        )
        process_linear_weights(self.model, linear_method)
        self.model.embed_from_lm_head_codes()  # NOTE: the tied table kept once, as the LM head's codes
        # The step functions (step_functions.py): the model's forward serves every step; `decode_step`, where set,
        # serves decode-only steps. NOTE: this is the seam where a CUDA-graph replay of decode steps plugs in.
        self.decode_step: StepFunction | None = None
        self.mixed_step: StepFunction | None = None  # steps with prefill chunks (CUDA graphs: mixed_graphs.py)
        self.model.use_layer_ops(select_layer_ops(self.device, self.dtype, backend.name))
        # NOTE: the native step has no collective between its layers: under tensor parallelism decode steps run the
        # layer loop (docs/architecture.md, "Tensor parallelism").
        native = (
            can_pack(self.device, self.dtype)
            and cpu_kernels.available()
            and backend.name == "cpu"
            and linear_method.native_decode
        )
        if native and self.tp.size == 1:
            self.decode_step = NativeDecodeStep(self.model)  # NOTE: it writes K/V in the cpu backend's way
        self.model.rotary.to(torch.float32)  # cos/sin tables stay fp32, cast per use
        log.info(
            "model loaded",
            architecture=arch,
            dtype=config.resolved_dtype,
            kv_cache_dtype=dtype_name(self.kv_dtype),
            linears=linear_method.name,
            seconds=round(time.perf_counter() - t0, 2),
        )
        self.kv = PagedKvCache(
            hf.num_hidden_layers, config.block_size, num_kv_heads, head_dim, self.kv_dtype, self.device
        )
        self.info = ModelInfo(
            architecture=arch,
            vocab_size=hf.vocab_size,
            max_model_len=self.max_model_len,
            num_layers=hf.num_hidden_layers,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            block_bytes=self.kv.block_bytes,
        )
        self.sampler = Sampler()
        # NOTE: kept across reset(): the tokenizer (built by the first constrained request) and the compiled grammars.
        self.grammar_backend = backend_for_model(model_dir, hf.vocab_size, getattr(hf, "eos_token_id", None))
        self.last_timings = StepTimings()  # of the latest execute(); read by the worker service for its spans
        self.max_blocks_per_seq = math.ceil(self.max_model_len / config.block_size)
        self.draft = self._load_draft()
        self.reset()
        release_free_heap()  # NOTE: the loaders' freed temporaries back to the kernel (host_allocator.py)
        # CPU: the large steps' freed activations back to the kernel once only small steps follow (host_allocator.py)
        self.heap_release = HeapRelease() if self.device.type == "cpu" else None
        # CUDA: a step's inputs travel through pinned buffers into persistent device tensors (device_inputs.py), and
        # decode-only steps (cuda_graphs.py) and steps with prefill chunks (mixed_graphs.py) replay CUDA graphs,
        # captured in init_kv_cache, unless enforce_eager.
        self._staging: DeviceInputs | None = None
        if self.device.type == "cuda":
            max_rows = config.max_num_seqs
            max_tokens = max(config.max_num_batched_tokens, max_rows)
            self._staging = DeviceInputs(self.device, step_input_specs(max_tokens, max_rows, self.max_blocks_per_seq))
            if backend.name == "triton" and not config.enforce_eager:
                self.decode_step, self.mixed_step = cuda_graph_steps(
                    self.model, self.device, max_rows, max_tokens, self.max_blocks_per_seq, self.max_model_len,
                    num_kv_heads,
                )  # fmt: skip

    def _load_draft(self) -> DraftRunner | None:
        """speculative_config method draft_model: the draft model and its proposer (draft_runner.py)."""
        spec = self.config.speculative_config
        if spec is None or spec.method != "draft_model":
            return None
        assert spec.model is not None  # SpeculativeConfig checks it
        draft_dir = resolve_model_dir(spec.model, self.config.cache_dir)
        vocab, max_len = self.info.vocab_size, self.max_model_len
        draft = DraftModel(self.config, draft_dir, vocab, max_len, self.dtype, self.gemm_dtype)
        return DraftRunner(self.config, spec, draft, max_len)

    def reset(self) -> None:
        """Forgets every sequence (a new scheduler, i.e. cache epoch, restarts seq ids): a fresh persistent batch and
        sampling state; weights and KV cache stay.

        NOTE: a step that raised may have left the batch half-updated (a row in the batch but not in the sampling
        state, or the reverse); rebuilding both is the only reset that cannot leave a poisoned row behind."""
        max_rows = self.config.max_num_seqs
        if hasattr(self, "sampling"):
            self.sampling.structured_output.close()  # its mask thread, if it started one
        self.batch = InputBatch(max_rows, self.max_model_len, self.max_blocks_per_seq, self.config.block_size)
        self.sampling = SamplingBatch(
            self.info.vocab_size, self.device, max_rows, seed=self.config.seed, grammar_backend=self.grammar_backend
        )
        self._prompt_logprob_seqs: set[int] = set()
        self.grammars = PendingGrammars(self.grammar_backend)  # compiles the scheduler's gate waits for

    # ---- KV cache -------------------------------------------------------------------------------------------
    def profile_num_blocks(self) -> int:
        """How many KV blocks fit in the configured budget."""
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = int(free * self.config.gpu_memory_utilization)
        else:
            budget = int(self.config.kv_cache_memory * GIB)
        per_block = self.info.block_bytes
        if self.draft is not None:  # NOTE: the draft's cache has a block for each of the pool's, plus its scratch
            per_block += self.draft.model.block_bytes
            budget -= self.draft.scratch_blocks * self.draft.model.block_bytes
        return max(2, budget // per_block)

    @property
    def kv_caches(self) -> list[torch.Tensor]:
        return self.kv.layers

    def init_kv_cache(self, num_blocks: int) -> None:
        info = self.info
        setting = "num_kv_blocks" if self.config.num_kv_blocks is not None else "kv_cache_memory"
        self.kv.allocate(num_blocks, setting)
        if self.draft is not None:
            self.draft.init_kv_cache(num_blocks, setting)
        tokens = num_blocks * self.config.block_size
        log.info(
            "KV cache allocated",
            blocks=num_blocks,
            block_size=self.config.block_size,
            gib=round(num_blocks * info.block_bytes / GIB, 3),
            tokens=tokens,
            max_concurrency_at_max_model_len=round(tokens / self.max_model_len, 2),
        )
        capture_graphs(self.decode_step, self.mixed_step, self.kv_caches)

    def release_idle_heap(self) -> None:
        """Nothing is left to run (`LLM.generate` returned; a worker that no step reached for a while): the heap's
        free pages that the steps since the last release left go back to the kernel (`HeapRelease.after_idle`).
        Call it on the thread that runs steps, between them."""
        if self.heap_release is not None:
            self.heap_release.after_idle()

    # ---- one step -------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        # NOTE: four perf_counter() readings per step (well under a microsecond each) so the worker can show the
        # step's phases; a fresh object per step, so a reader never sees a half-written one.
        timings = self.last_timings = StepTimings(start=time.perf_counter())
        prefaulter = self.kv.prefaulter
        if prefaulter is not None:
            prefaulter.pause()
        grammars = self.grammars
        if plan.grammars:
            grammars.submit(plan.grammars)  # NOTE: compiled on the backend's thread while this step runs
        try:
            out = self._execute(plan, timings)
        finally:
            if prefaulter is not None:
                prefaulter.resume()
        if self.heap_release is not None:
            self.heap_release.after_step(plan.total_num_scheduled_tokens)
        if grammars:
            out.grammar_results = grammars.poll(IDLE_WAIT_S if plan.is_empty else 0.0)
        timings.end = time.perf_counter()
        if self.tp.size > 1:
            timings.collective_s = collectives.CLOCK.take()
        return out

    def _execute(self, plan: SchedulerOutput, timings: StepTimings) -> ModelRunnerOutput:
        self._apply_deltas(plan)
        if plan.is_empty:
            return ModelRunnerOutput()
        seq_ids = list(plan.num_scheduled_tokens)
        drafts = plan.scheduled_spec_decode_tokens
        if drafts:
            write_drafts(self.batch, drafts)
        inputs = self.batch.prepare(seq_ids, list(plan.num_scheduled_tokens.values()))
        sample_idx = np.flatnonzero(inputs.sample_mask)
        sample_seq_ids = [inputs.seq_ids[i] for i in sample_idx]
        logit_index = inputs.query_start_loc[1:][sample_idx] - 1
        # Speculative decoding: a verified row samples each of its 1 + k positions (spec_verify.py).
        verify = Verification.plan(inputs, sample_idx, sample_seq_ids, drafts) if drafts else None
        if verify is not None:
            logit_index, sample_seq_ids = verify.logit_index, verify.row_seq_ids
        # NOTE: every host-to-device copy of the step is queued before the forward (non-blocking from pinned buffers
        # on CUDA), and so is the sampling metadata: nothing after the forward makes the host wait for it, until the
        # sampled tokens come back.
        if self._staging is not None:
            self._staging.begin()
        # NOTE: a step of decode and verification rows only runs as decode rows, one per query token (verify_rows.py)
        decode_rows = as_decode_rows(inputs, drafts, self.config.max_num_seqs) if drafts else None
        meta = attention_metadata(
            decode_rows or inputs, self.batch, self.config.block_size, self._to_device, self._staging is not None
        )
        input_ids = self._to_device("input_ids", inputs.input_ids)
        positions = self._to_device("positions", inputs.positions)
        last_token = self._to_device("sample_index", logit_index)
        if self._staging is not None:
            self._staging.end()
        sample_here = len(sample_idx) and self.tp.is_driver
        sampling_meta = batch_metadata(self.sampling, sample_seq_ids) if sample_here else None
        self.backend.prepare(meta)
        timings.forward_start = time.perf_counter()
        step = pick_step_function(self.model, self.decode_step, meta, self.mixed_step)
        # NOTE: an int8 decode step may run the LM head, and an all-greedy one its pick, in the native call (head_step)
        head = fused_head(step, meta, len(sample_seq_ids), sampling_meta, bool(drafts or self._prompt_logprob_seqs))
        fused = None if head is None else head.run(input_ids, positions, self.kv_caches, meta)
        hidden = step(input_ids, positions, self.kv_caches, meta) if fused is None else None
        timings.sample_start = time.perf_counter()
        out = ModelRunnerOutput()
        if self._prompt_logprob_seqs and hidden is not None:  # NOTE: fused_head leaves such steps unfused
            out.prompt_logprobs = prompt_logprobs(self.model, self.batch, inputs, hidden, self.device)
        if not len(sample_idx):
            self.batch.advance(inputs, sample_idx, sample_idx)
            return out
        # None on a rank other than 0, and where the fused head picked the tokens
        logits = self.model.compute_logits(hidden[last_token]) if fused is None else fused.logits
        if fused is not None and fused.tokens is not None:
            sampled = picked_step(self.sampling, fused.tokens, sample_seq_ids)
        else:
            sampled = sample_on_driver(
                self.tp,
                len(sample_seq_ids),
                logits,
                lambda logits: sample_step(self.sampler, self.sampling, logits, sample_seq_ids, sampling_meta),
                self.device,
            )
        # NOTE: a failed row's sequence ends, but a step planned ahead may still feed its token back: keep it a
        # valid id in the batch.
        tokens = sampled.tokens
        out.errors = sampled.errors
        if verify is not None:
            if self.draft is not None:
                self.draft.resample(verify, logits, sampled, self.batch, self.sampling)
            out = emit_verified(out, verify, inputs, sample_idx, sampled, self.batch, self.sampling)
        else:
            self.batch.advance(inputs, inputs.rows[sample_idx], np.where(tokens == FAILED_TOKEN, 0, tokens))
            out.seq_ids = sample_seq_ids
            out.sampled_token_ids = tokens.tolist()
            out.logprobs = sampled.logprobs
        if self.draft is not None:
            proposing = [s for s in dict.fromkeys(out.seq_ids) if s not in out.errors]
            out.draft_token_ids = self.draft.propose(self.batch, self.sampling, proposing)
        return out

    def _forget(self, seq_id: int) -> None:
        self.batch.remove(seq_id)
        self.sampling.remove(seq_id)
        self._prompt_logprob_seqs.discard(seq_id)
        if self.draft is not None:
            self.draft.forget(seq_id)

    def _apply_deltas(self, plan: SchedulerOutput) -> None:
        if plan.beam_deltas:
            apply_beam_deltas(self.batch, self.sampling, plan.beam_deltas, plan.finished_seq_ids, self._forget)
        for seq_id in plan.finished_seq_ids:
            self._forget(seq_id)
        for new in plan.new_seqs:
            if new.sampling_params.prompt_logprobs is not None:
                self._prompt_logprob_seqs.add(new.seq_id)
            self.batch.add(
                new.seq_id,
                new.token_ids,
                new.num_prompt_tokens,
                new.block_ids,
                new.num_computed_tokens,
                new.sampling_params,
            )
            self.sampling.add(
                new.seq_id,
                new.sampling_params,
                new.seed,
                new.token_ids[: new.num_prompt_tokens],
                new.token_ids[new.num_prompt_tokens :],
            )
        for cached in plan.cached_seqs:
            self.batch.append_blocks(cached.seq_id, cached.new_block_ids)
        if plan.copy_blocks:
            self.kv.copy_blocks(plan.copy_blocks)
        walk = self.kv.prefaulter
        if walk is not None and not walk.finished:  # NOTE: the KV walk stays near the blocks handed out (kv_prefault)
            walk.reached(highest_new_block(plan))

    def _to_device(self, name: str, values: np.ndarray) -> torch.Tensor:
        """One step input on the model's device: through the pinned staging buffers on CUDA, as is on CPU."""
        if self._staging is None:
            return torch.from_numpy(values).to(self.device)
        return self._staging.put(name, values)
