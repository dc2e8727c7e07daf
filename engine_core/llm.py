"""The offline API, as in vLLM: `LLM(model=...).generate(prompts, SamplingParams(...))` and `.chat(messages)`."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from tqdm.auto import tqdm

from engine_core.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence, beam_request
from engine_core.checkpoint.model_files import model_name, read_generation_eos, resolve_model_dir
from engine_core.config import EngineConfig
from engine_core.core.beam_group import BeamGroup
from engine_core.core.prompt_checks import check_token_ids
from engine_core.core.request import FinishReason, Request
from engine_core.distributed.parallel_state import check_heads
from engine_core.engine import EngineCore
from engine_core.io.bad_words import bad_words_token_ids
from engine_core.io.output_processor import OutputProcessor
from engine_core.io.request_output import RequestMetrics, RequestOutput
from engine_core.io.tokenizer import Tokenizer, hf_tokenizer, load_tokenizer
from engine_core.model.loader import load_config
from engine_core.sampling_params import SamplingParams, with_eos
from engine_core.worker.model_runner import ModelRunner
from engine_core.worker.rank_processes import RankProcesses
from engine_core.worker.tp_executor import TensorParallelExecutor

PromptType = str | dict[str, Any]
ChatMessages = list[dict[str, str]]


@dataclass
class LoadedEngine:
    core: EngineCore
    runner: ModelRunner
    tokenizer: Tokenizer
    tokenizer_dir: str
    model_name: str
    eos_token_id: int | None
    tensor_parallel: TensorParallelExecutor | None = None  # ranks 1.. (tensor_parallel_size > 1), stopped by close

    def close(self) -> None:
        if self.tensor_parallel is not None:
            self.tensor_parallel.close()


def load_engine(config: EngineConfig) -> LoadedEngine:
    """Resolves the model, loads the runner and sizes the KV cache: the one-process engine, plus, with
    tensor_parallel_size > 1, ranks 1.. as processes of their own (engine_core.worker.rank_processes.py)."""
    model_dir = resolve_model_dir(config.model, config.cache_dir)
    ranks = None
    if config.tensor_parallel_size > 1:
        hf = load_config(model_dir)
        check_heads(hf.num_attention_heads, hf.num_key_value_heads, config.tensor_parallel_size)  # before any spawn
        ranks = RankProcesses(config, model_dir)  # they load their shards while rank 0 loads its own
    try:
        runner = ModelRunner(config, model_dir)  # NOTE: first: it starts the weights' disk read (prefetch_weights)
        tokenizer_dir = config.tokenizer or model_dir
        tokenizer = load_tokenizer(tokenizer_dir, config.cache_dir)
        num_blocks = runner.profile_num_blocks()
        executor: ModelRunner | TensorParallelExecutor = runner
        tensor_parallel = None
        if ranks is not None:
            num_blocks = min(num_blocks, *ranks.wait_loaded())  # identical block tables: one count for every rank
            executor = tensor_parallel = TensorParallelExecutor(runner, ranks)
            tensor_parallel.init_cache(num_blocks)
        else:
            runner.init_kv_cache(num_blocks)
    except BaseException:
        if ranks is not None:
            ranks.stop()
        raise
    core = EngineCore(config, executor, runner.max_model_len, num_blocks)
    core.beam_decode = partial(tokenizer.decode, skip_special_tokens=True)
    eos = tokenizer.eos_token_id
    if eos is None:
        eos = next(iter(read_generation_eos(model_dir)), None)
    return LoadedEngine(core, runner, tokenizer, tokenizer_dir, model_name(config.model), eos, tensor_parallel)


class LLM:
    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        self.config = EngineConfig.from_kwargs(model=model, **engine_args)
        self.engine = load_engine(self.config)
        self.tokenizer = self.engine.tokenizer  # what the engine tokenizes and detokenizes with
        self._hf_tokenizer: Any = None
        self._ids = itertools.count()

    @property
    def core(self) -> EngineCore:
        return self.engine.core

    def shutdown(self) -> None:
        """Stops the tensor-parallel rank processes, if any (also done at interpreter exit). Idempotent."""
        self.engine.close()

    def get_tokenizer(self) -> Any:
        """transformers' tokenizer of the model, as vLLM's `LLM.get_tokenizer()` returns (loaded on the first call).

        NOTE: the engine itself uses `self.tokenizer`, a snapshot of this same tokenizer that runs without
        transformers (engine_core/io/tokenizer.py); both give the same ids and text (tests/test_tokenizer.py).
        """
        if self._hf_tokenizer is None:
            self._hf_tokenizer = hf_tokenizer(self.engine.tokenizer_dir)
        return self._hf_tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        cache_salt: str | None = None,
    ) -> list[RequestOutput]:
        prompt_list = [prompts] if isinstance(prompts, str | dict) else list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params_list = (
            [sampling_params] * len(prompt_list) if isinstance(sampling_params, SamplingParams) else sampling_params
        )
        if len(params_list) != len(prompt_list):
            raise ValueError(f"got {len(prompt_list)} prompts but {len(params_list)} sampling_params")
        if priority is not None and len(priority) != len(prompt_list):
            raise ValueError(f"got {len(prompt_list)} prompts but {len(priority)} priorities")
        processor = OutputProcessor(self.tokenizer)
        order: list[Request] = []
        try:
            for i, (prompt, params) in enumerate(zip(prompt_list, params_list, strict=True)):
                text, token_ids = self._tokenize(prompt)
                request_id = str(next(self._ids))
                params = with_eos(
                    params, self.engine.eos_token_id, self.engine.runner.info.vocab_size, self._bad_words(params)
                )
                prio = priority[i] if priority else 0
                request = Request(request_id, token_ids, params, priority=prio, cache_salt=cache_salt, prompt=text)
                self.core.add_request(request)
                processor.add_request(request_id, text, token_ids, params, request.timings.arrival)
                order.append(request)
        except BaseException:
            for queued in order:  # a bad prompt rejects the whole call: nothing stays queued
                self.core.abort(queued.request_id)
            raise
        return self._run(processor, order, use_tqdm)

    def beam_search(
        self, prompts: PromptType | Sequence[PromptType], params: BeamSearchParams, use_tqdm: bool = False
    ) -> list[BeamSearchOutput]:
        """Beam search in the engine (vLLM's signature and result shape; transformers' semantics, see
        docs/beam_search.md): each output's `sequences` are the best hypotheses, best first."""
        prompt_list = [prompts] if isinstance(prompts, str | dict) else list(prompts)
        groups: list[tuple[Request, BeamGroup]] = []
        try:
            for prompt in prompt_list:
                text, token_ids = self._tokenize(prompt)
                vocab = self.engine.runner.info.vocab_size
                eos, max_len = self.engine.eos_token_id, self.core.max_model_len
                request, group = beam_request(
                    str(next(self._ids)), token_ids, params, eos, vocab, max_len, text, self.core.beam_decode
                )
                self.core.add_request(request, group)
                groups.append((request, group))
        except BaseException:
            for queued, _ in groups:
                self.core.abort(queued.request_id)
            raise
        bar = tqdm(total=len(groups), desc="Beam search", disable=not use_tqdm)
        try:
            while self.core.has_unfinished:
                for out in self.core.step():
                    if out.error:
                        raise RuntimeError(f"beam search request {out.request_id} failed: {out.error}")
                bar.n = sum(g.done for _, g in groups)
                bar.refresh()
        except BaseException:
            for request, _ in groups:
                self.core.abort(request.request_id)
            raise
        finally:
            bar.close()
        return [self._beam_output(request, group, params) for request, group in groups]

    def _beam_output(self, request: Request, group: BeamGroup, params: BeamSearchParams) -> BeamSearchOutput:
        sequences = []
        for hyp in group.results():
            tokens = request.prompt_token_ids + hyp.output_token_ids
            # NOTE: vLLM's shape: `tokens` and `text` hold the prompt too. A stop string ended the beam in the search
            # (core/beam_stop.py) and ends the text here (kept with include_stop_str_in_output).
            prompt_text = self.tokenizer.decode(request.prompt_token_ids, skip_special_tokens=True)
            out_text = self.tokenizer.decode(hyp.output_token_ids, skip_special_tokens=True)
            stop_reason: int | str | None = None
            hits = [(out_text.find(s), s) for s in params.stop or [] if s in out_text]
            if hits:
                at, stop = min(hits)
                out_text = out_text[: at + len(stop)] if params.include_stop_str_in_output else out_text[:at]
                stop_reason = stop
            elif hyp.stopped and hyp.output_token_ids[-1] != request.sampling_params.eos_token_id:
                stop_reason = hyp.output_token_ids[-1]
            sequences.append(
                BeamSearchSequence(
                    tokens=tokens,
                    cum_logprob=hyp.cum_logprob,
                    text=prompt_text + out_text,
                    score=hyp.score,
                    finish_reason="stop" if hyp.stopped or hits else "length",
                    stop_reason=stop_reason,
                )
            )
        return BeamSearchOutput(sequences)

    def chat(
        self,
        messages: ChatMessages | Sequence[ChatMessages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        content_special_tokens: bool = False,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[RequestOutput]:
        """`content_special_tokens`: read special-token text in the messages as control tokens (trusted messages
        only); by default it is plain text, so a message cannot forge a turn. `tools`: tool definitions for the
        chat template, as transformers' `apply_chat_template(tools=...)` and vLLM's `LLM.chat(tools=...)` take them."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts: list[PromptType] = [
            {"prompt_token_ids": self.apply_chat_template(conv, add_generation_prompt, content_special_tokens, tools)}
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def apply_chat_template(
        self,
        messages: ChatMessages,
        add_generation_prompt: bool = True,
        content_special_tokens: bool = False,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt, content_special_tokens, tools)

    def _bad_words(self, params: SamplingParams) -> list[list[int]] | None:
        if not params.bad_words:
            return None
        return bad_words_token_ids(lambda text: self.tokenizer.encode(text, add_special_tokens=False), params.bad_words)

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, list(self.tokenizer.encode(prompt))
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            ids = [int(t) for t in prompt["prompt_token_ids"]]
            check_token_ids(ids, self.engine.runner.info.vocab_size)
            return prompt.get("prompt"), ids
        if isinstance(prompt, dict) and "prompt" in prompt:
            return prompt["prompt"], list(self.tokenizer.encode(prompt["prompt"]))
        raise TypeError("a prompt is a string, {'prompt': str} or {'prompt_token_ids': [int, ...]}")

    def _run(self, processor: OutputProcessor, order: list[Request], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(order), desc="Processed prompts", disable=not use_tqdm)
        try:
            while self.core.has_unfinished:
                step = processor.process(self.core.step())
                for stop in step.stops:
                    self.core.finish_choice(stop.request_id, stop.index, FinishReason.STOP_STRING, stop.stop)
                for update in step.updates:
                    if update.output.finished:
                        finished[update.output.request_id] = update.output
                        bar.update(1)
        except BaseException:
            for request in order:
                if request.request_id not in finished:
                    self.core.abort(request.request_id)
            raise
        finally:
            bar.close()
        self.engine.runner.release_idle_heap()
        outputs = [finished[r.request_id] for r in order]
        for request, output in zip(order, outputs, strict=True):
            # The core's own clock: scheduling and first-token times as the scheduler saw them.
            t = request.timings
            output.metrics = RequestMetrics(t.arrival, t.first_scheduled, t.first_token, t.finished)
        return outputs
