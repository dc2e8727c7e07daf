"""SamplingParams <-> SamplingOptions. Unset optional fields keep the engine's defaults."""

from __future__ import annotations

from engine_core.sampling_params import SamplingParams
from services.convert.structured_outputs import structured_outputs_from_proto, structured_outputs_to_proto
from services.rpc import common_pb2

# SamplingOptions.early_stopping's strings; anything else is refused by SamplingParams, naming the field.
_EARLY_STOPPING: dict[str, bool | str] = {"": False, "false": False, "true": True, "never": "never"}

# Optional scalar fields that map 1:1 onto SamplingParams attributes.
_SCALARS = (
    "n",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
    "seed",
    "max_tokens",
    "min_tokens",
    "ignore_eos",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "logprobs",
    "prompt_logprobs",
)


def params_from_proto(opts: common_pb2.SamplingOptions, *, internal: bool = False) -> SamplingParams:
    """Builds (and so validates) SamplingParams; a bad field raises ValueError starting with its name.

    `internal` also takes `eos_token_id` and `bad_words_token_ids`, which only the frontend sets (from its tokenizer).
    """
    kwargs: dict[str, object] = {name: getattr(opts, name) for name in _SCALARS if opts.HasField(name)}
    if opts.unlimited_max_tokens:
        if opts.HasField("max_tokens"):
            raise ValueError("max_tokens must be unset when unlimited_max_tokens is true")
        kwargs["max_tokens"] = None
    if opts.stop:
        kwargs["stop"] = list(opts.stop)
    if opts.stop_token_ids:
        kwargs["stop_token_ids"] = list(opts.stop_token_ids)
    if opts.logit_bias:
        kwargs["logit_bias"] = dict(opts.logit_bias)
    if opts.bad_words:
        kwargs["bad_words"] = list(opts.bad_words)
    if opts.allowed_token_ids:
        kwargs["allowed_token_ids"] = list(opts.allowed_token_ids)
    if opts.HasField("structured_outputs"):
        kwargs["structured_outputs"] = structured_outputs_from_proto(opts.structured_outputs)
    if internal and opts.bad_words_token_ids:
        kwargs["bad_words_token_ids"] = [list(seq.token_ids) for seq in opts.bad_words_token_ids]
    if opts.use_beam_search:
        kwargs["use_beam_search"] = True
        kwargs.setdefault("temperature", 0.0)  # NOTE: unset means greedy here: beam search is deterministic
        if opts.HasField("beam_width"):
            kwargs["beam_width"] = opts.beam_width
        if opts.HasField("length_penalty"):
            kwargs["length_penalty"] = opts.length_penalty
        kwargs["early_stopping"] = _EARLY_STOPPING.get(opts.early_stopping, opts.early_stopping)
    params = SamplingParams(**kwargs)  # type: ignore[arg-type]
    if internal and opts.HasField("eos_token_id"):
        params.eos_token_id = opts.eos_token_id
    if internal:
        params.num_beam_candidates = opts.num_beam_candidates
    return params


def params_to_proto(params: SamplingParams, *, with_stop_strings: bool = True) -> common_pb2.SamplingOptions:
    """Every field, explicitly (the receiver must not depend on its own defaults).

    `with_stop_strings=False` for the internal hops: stop strings are matched by the frontend's detokenizer and bad
    words travel as token ids, so the scheduler and workers never need the strings (they would ride along in every
    step message)."""
    opts = common_pb2.SamplingOptions()
    for name in _SCALARS:
        value = getattr(params, name)
        if value is not None:
            setattr(opts, name, value)
    if params.max_tokens is None:
        opts.unlimited_max_tokens = True
    if params.stop and with_stop_strings:
        opts.stop.extend(params.stop)
    if params.stop_token_ids:
        opts.stop_token_ids.extend(params.stop_token_ids)
    if params.logit_bias:
        for tok, bias in params.logit_bias.items():
            opts.logit_bias[tok] = bias
    if params.bad_words and with_stop_strings:
        opts.bad_words.extend(params.bad_words)
    if params.allowed_token_ids:
        opts.allowed_token_ids.extend(params.allowed_token_ids)
    for seq in params.bad_words_token_ids or []:
        opts.bad_words_token_ids.add(token_ids=seq)
    if params.eos_token_id is not None:
        opts.eos_token_id = params.eos_token_id
    if params.structured_outputs is not None:
        structured_outputs_to_proto(params.structured_outputs, opts.structured_outputs)
    opts.num_beam_candidates = params.num_beam_candidates
    if params.use_beam_search:
        opts.use_beam_search = True
        if params.beam_width is not None:
            opts.beam_width = params.beam_width
        opts.length_penalty = params.length_penalty
        opts.early_stopping = str(params.early_stopping).lower()
    return opts
