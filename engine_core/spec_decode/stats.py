"""Speculative decoding counters, named as vLLM's spec_decode metrics (services export them under `pagoda:`)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    num_drafts: int = 0  # verification rows (one per sequence per step that carried drafts)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # accepted_per_pos[i]: drafts accepted at draft position i (0-based)
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def record(self, num_draft: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        per_pos = self.num_accepted_tokens_per_pos
        if len(per_pos) < num_draft:
            per_pos.extend([0] * (num_draft - len(per_pos)))
        for i in range(num_accepted):
            per_pos[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verification row: accepted drafts plus the one the target samples itself."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0
