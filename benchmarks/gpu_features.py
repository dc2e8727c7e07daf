"""`make gpu-check`'s engine-feature sections: speculative decoding and the request features on a GPU.

The CPU suite tests every feature on CPU tensors; what only a GPU shows is a device mismatch (a mask or an index
built on the host beside CUDA logits) or a CUDA-graph replay that a feature's rows break. So each feature runs
through `LLM` on the Triton backend with its CUDA graphs, and each check asserts what the feature promises (an
allowed-token set, a grammar, a seed's determinism, speculation's token identity), not a number.

Every check is recorded on its own (`ok` or the error), so one failure does not hide the others; the section fails
when any check does.
"""

from __future__ import annotations

import gc
import json
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch


def free_gpu_memory() -> None:
    """Before the next engine sizes its KV cache from free memory: drop the last one (cycles included). Shared by
    gpu_check's sections."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _llm(model_dir: Path, device: str, dtype: str, **kw: object) -> object:
    from engine_core import LLM

    return LLM(
        str(model_dir),
        device=device,
        # NOTE: a dry run (CPU) checks the wiring only: the Triton interpreter would take minutes here.
        attention_backend="triton" if device == "cuda" else "torch",
        dtype=dtype,
        num_kv_blocks=512,
        max_num_batched_tokens=256,
        max_num_seqs=16,
        **kw,
    )


def _close(llm: object) -> None:
    llm.shutdown()  # type: ignore[attr-defined]
    del llm
    free_gpu_memory()


def _run_checks(checks: dict[str, Callable[[], object]]) -> dict[str, object]:
    results: dict[str, object] = {}
    failed = []
    for name, fn in checks.items():
        t0 = time.monotonic()
        try:
            results[name] = {"ok": True, "result": fn(), "seconds": round(time.monotonic() - t0, 2)}
        except Exception as e:  # recorded; the next check still runs
            results[name] = {"ok": False, "error": f"{type(e).__name__}: {e}", "tb": traceback.format_exc()[-1500:]}
            failed.append(name)
    results["failed"] = failed
    if failed:
        raise AssertionError(f"failed checks: {failed}; results: {json.dumps(results, default=str)[:6000]}")
    return results


def _random_prompts(vocab: int, lengths: tuple[int, ...], seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab - 1, (k,), generator=gen).tolist() for k in lengths]


def spec_decode_check(model_dir: Path, device: str, dry_run: bool, vocab: int) -> dict[str, object]:
    """Greedy with ngram / suffix speculation == without (float32, CUDA graphs: verification rows replay as decode
    rows); then batch-1 ms per token on / off in the serving dtype."""
    from engine_core import SamplingParams

    n = 8 if dry_run else 48
    base = _random_prompts(vocab, (9, 20) if dry_run else (9, 40, 120, 300), seed=3)
    greedy = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    methods = {
        "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4},
        "suffix": {"method": "suffix"},
    }

    def tokens(llm: object, prompts: list[list[int]]) -> list[list[int]]:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)  # type: ignore[attr-defined]
        return [o.outputs[0].token_ids for o in outs]

    # NOTE: the suffix drafter learns from earlier outputs: its second pass over the same prompts drafts each output
    # from the first pass's, so drafts are accepted (verified tokens' KV kept, the rest rolled back). A random
    # model's output seldom repeats its prompt, so the n-gram drafter's proposals (when any) are mostly rejected.
    llm = _llm(model_dir, device, "float32")
    prompts = [p + g for p, g in zip(base, tokens(llm, base), strict=True)]
    plain = tokens(llm, prompts)
    _close(llm)
    result: dict[str, object] = {"prompt_lengths": [len(p) for p in prompts], "new_tokens": n}

    def equal(method: str) -> Callable[[], object]:
        def run() -> object:
            llm = _llm(model_dir, device, "float32", speculative_config=methods[method])
            passes = [tokens(llm, prompts) for _ in range(2 if method == "suffix" else 1)]
            stats = llm.core.stats()  # type: ignore[attr-defined]
            _close(llm)
            for got in passes:
                first_diff = [
                    next((i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), None)
                    for x, y in zip(got, plain, strict=True)
                ]
                assert got == plain, f"speculation changed greedy tokens; first differing position {first_diff}"
            if method == "suffix":  # the second pass drafts from the first's outputs
                assert stats.spec_decode_num_accepted_tokens > 0, "no accepted drafts: the check would prove little"
            return {
                "draft_tokens": stats.spec_decode_num_draft_tokens,
                "accepted_tokens": stats.spec_decode_num_accepted_tokens,
            }

        return run

    def batch1() -> object:
        dtype = "float32" if dry_run else "bfloat16"
        prompt = prompts[-1]
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        ms: dict[str, float] = {}
        for arm, spec in (("off", None), ("ngram", methods["ngram"]), ("suffix", methods["suffix"])):
            llm = _llm(model_dir, device, dtype, **({"speculative_config": spec} if spec else {}))
            llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)  # type: ignore[attr-defined]
            torch.cuda.synchronize() if torch.cuda.is_available() else None
            t0 = time.perf_counter()
            for _ in range(1 if dry_run else 3):
                llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)  # type: ignore[attr-defined]
            ms[arm] = round((time.perf_counter() - t0) * 1000 / ((1 if dry_run else 3) * n), 3)
            _close(llm)
        # NOTE: one request repeated: the suffix arm drafts from the earlier passes' outputs (its best case); the
        # n-gram arm finds few matches in a random model's text (its overhead when drafts fail).
        return {"dtype": dtype, "prompt_tokens": len(prompt), "new_tokens": n, "ms_per_token_with_prefill": ms}

    result["checks"] = _run_checks(
        {"ngram_eq_plain": equal("ngram"), "suffix_eq_plain": equal("suffix"), "batch1": batch1}
    )
    return result


def features_check(model_dir: Path, device: str, dry_run: bool, vocab: int) -> dict[str, object]:
    """The sampling controls, logprobs, structured outputs and beam search in the serving dtype, one engine."""
    from engine_core import BeamSearchParams, SamplingParams, StructuredOutputsParams

    dtype = "float32" if dry_run else "bfloat16"
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, vocab - 1, (k,), generator=gen).tolist() for k in (5, 33, 90)]
    reqs = [{"prompt_token_ids": p} for p in prompts]
    n = 6 if dry_run else 24
    llm = _llm(model_dir, device, dtype)

    def gen_ids(params: SamplingParams) -> list[list[list[int]]]:
        outs = llm.generate(reqs, params, use_tqdm=False)  # type: ignore[attr-defined]
        return [[c.token_ids for c in o.outputs] for o in outs]

    def seeded() -> object:
        p = SamplingParams(n=3, temperature=0.9, top_p=0.9, top_k=50, min_p=0.02, seed=7, max_tokens=n, ignore_eos=True)
        a, b = gen_ids(p), gen_ids(p)
        assert a == b, "the same seed gave different samples"
        return {"distinct_samples_per_prompt": [len({tuple(s) for s in group}) for group in a]}

    def allowed() -> object:
        ids = [3, 11, 19]
        p = SamplingParams(temperature=1.0, seed=1, allowed_token_ids=ids, max_tokens=n, ignore_eos=True)
        got = {t for group in gen_ids(p) for s in group for t in s}
        assert got <= set(ids), got - set(ids)
        return sorted(got)

    def bias_and_bad_words() -> object:
        p = SamplingParams(temperature=0, logit_bias={42: 100.0}, max_tokens=n, ignore_eos=True)
        assert all(set(s) == {42} for group in gen_ids(p) for s in group), "logit_bias +100 did not win"
        greedy = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        first = gen_ids(greedy)[0][0][0]
        banned = SamplingParams(temperature=0, bad_words=[f"t{first}"], max_tokens=n, ignore_eos=True)
        assert all(first not in s for group in gen_ids(banned) for s in group), f"bad word t{first} was generated"
        return {"banned_token": first}

    def penalties_and_min_tokens() -> object:
        eos = vocab - 1
        p = SamplingParams(
            temperature=0, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.5,
            logit_bias={eos: 100.0}, min_tokens=5, max_tokens=n,
        )  # fmt: skip
        lengths = [len(s) for group in gen_ids(p) for s in group]
        assert all(k == 6 for k in lengths), f"min_tokens 5 then a +100 EOS should give 6 tokens, got {lengths}"
        return lengths

    def logprobs() -> object:
        p = SamplingParams(temperature=0, logprobs=5, prompt_logprobs=3, max_tokens=n, ignore_eos=True)
        outs = llm.generate(reqs, p, use_tqdm=False)  # type: ignore[attr-defined]
        for o in outs:
            c = o.outputs[0]
            assert c.logprobs is not None and len(c.logprobs) == len(c.token_ids)
            for tok, pos in zip(c.token_ids, c.logprobs, strict=True):
                assert tok in pos and pos[tok].rank == 1 and len(pos) >= 5, pos
                assert all(lp.logprob <= 0.0 for lp in pos.values()), pos
            assert o.prompt_logprobs is not None and len(o.prompt_logprobs) == len(o.prompt_token_ids)
        return {"positions": sum(len(o.outputs[0].logprobs) for o in outs)}

    def structured() -> object:
        words = ["t500", "t600", "t700"]
        choice = SamplingParams(
            temperature=1.0, seed=2, max_tokens=n, structured_outputs=StructuredOutputsParams(choice=words)
        )
        texts = [o.outputs[0].text for o in llm.generate(reqs, choice, use_tqdm=False)]  # type: ignore[attr-defined]
        assert all(t in words for t in texts), texts
        # NOTE: choice alone: llguidance tokenizes the text a grammar forces, which this word-level vocabulary can
        # do only where it is a whole token or one byte; the mask's path on the GPU is the same for every grammar.
        return {"choice": texts}

    def beams() -> object:
        out = llm.beam_search(reqs[:2], BeamSearchParams(beam_width=4, max_tokens=n, ignore_eos=True))  # type: ignore[attr-defined]
        greedy = gen_ids(SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        width1 = llm.beam_search(reqs[:2], BeamSearchParams(beam_width=1, max_tokens=n, ignore_eos=True))  # type: ignore[attr-defined]
        for o in out:
            scores = [s.score for s in o.sequences]
            assert len(o.sequences) == 4 and scores == sorted(scores, reverse=True), scores
        for o, g, p in zip(width1, greedy, prompts, strict=False):
            assert o.sequences[0].tokens[len(p) :] == g[0], "beam width 1 differs from greedy"
        return {"best_scores": [round(o.sequences[0].score, 4) for o in out]}

    try:
        checks = {
            "seeded_sampling": seeded,
            "allowed_token_ids": allowed,
            "logit_bias_bad_words": bias_and_bad_words,
            "penalties_min_tokens": penalties_and_min_tokens,
            "logprobs": logprobs,
            "structured_outputs": structured,
            "beam_search": beams,
        }
        return {"dtype": dtype, "checks": _run_checks(checks)}
    finally:
        _close(llm)
