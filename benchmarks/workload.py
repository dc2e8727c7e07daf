"""The benchmark workloads, shared by every harness (and by the peer engines' subprocesses, so: stdlib only).

`random`: 64 requests of random token ids, prompt lengths uniform in [64, 512], output lengths uniform in [32, 256],
greedy, ignore_eos, seed 0 (the workload of docs/benchmarks.md since issue 2).
`prefix`: the same request and output counts, but every prompt starts with one of a few shared "system prompts"
followed by a short random suffix, so an engine with a prefix cache computes most prompt tokens once.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

VOCAB = 49152  # SmolLM2's vocabulary: the default model of every harness
BATCH1_PROMPT = 128  # batch-1 latency case: prompt length and new tokens
BATCH1_TOKENS = 128


@dataclass
class Workload:
    name: str
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.output_tokens


def make_workload(
    n: int, seed: int, vocab: int = VOCAB, in_range: tuple[int, int] = (64, 512), out_range: tuple[int, int] = (32, 256)
) -> Workload:
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(*in_range))] for _ in range(n)]
    return Workload("random", prompts, [rng.randint(*out_range) for _ in range(n)])


def make_prefix_workload(
    n: int,
    seed: int,
    vocab: int = VOCAB,
    num_prefixes: int = 4,
    prefix_len: int = 384,
    suffix_range: tuple[int, int] = (16, 128),
    out_range: tuple[int, int] = (32, 256),
) -> Workload:
    """Requests spread round-robin over `num_prefixes` shared system prompts (the shape of a chat service with a few
    assistants): prompts of 400-512 tokens of which 384 are shared."""
    rng = random.Random(seed + 1)
    prefixes = [[rng.randrange(vocab) for _ in range(prefix_len)] for _ in range(num_prefixes)]
    prompts = [
        prefixes[i % num_prefixes] + [rng.randrange(vocab) for _ in range(rng.randint(*suffix_range))] for i in range(n)
    ]
    return Workload("prefix", prompts, [rng.randint(*out_range) for _ in range(n)])


def make(name: str, n: int, seed: int) -> Workload:
    if name == "random":
        return make_workload(n, seed)
    if name == "prefix":
        return make_prefix_workload(n, seed)
    raise ValueError(f"unknown workload {name!r} (random | prefix)")


def batch1_prompt(length: int = BATCH1_PROMPT, vocab: int = VOCAB) -> list[int]:
    """The batch-1 prompt of every harness (ids away from the special tokens at the start of the vocabulary)."""
    rng = random.Random(7)
    return [rng.randrange(1000, min(20000, vocab)) for _ in range(length)]
