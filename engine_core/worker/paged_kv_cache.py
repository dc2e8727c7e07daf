"""A model's paged KV cache: one `[2, blocks, block_size, kv_heads, head_dim]` tensor per layer (K and V), the
block ids the scheduler's block tables name. The target model's runner and the draft model (draft_model method) each
hold one."""

from __future__ import annotations

import torch

from engine_core.worker.host_memory import zeroed_host_tensor
from engine_core.worker.kv_prefault import KvPrefaulter


class PagedKvCache:
    def __init__(
        self,
        num_layers: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.num_layers, self.block_size, self.num_kv_heads, self.head_dim = (
            num_layers,
            block_size,
            num_kv_heads,
            head_dim,
        )
        self.dtype, self.device = dtype, device
        self.layers: list[torch.Tensor] = []
        self._whole: torch.Tensor | None = None  # CPU: the one mapping under every layer's view
        self.prefaulter: KvPrefaulter | None = None  # CPU: faults the cache in between steps (kv_prefault.py)

    @property
    def block_bytes(self) -> int:
        """Bytes one block takes across all layers."""
        elt = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * self.block_size * self.num_kv_heads * self.head_dim * elt * self.num_layers

    def allocate(self, num_blocks: int, setting: str, prefault: bool = True) -> None:
        """`setting`: the flag that sized it (named when the host cannot map it)."""
        shape = (2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        # NOTE: zeros, not empty: padded block-table entries point at block 0, and garbage there could be NaN. On the
        # host, one lazily-faulted zero mapping (host_memory.py) instead of torch.zeros writing every byte (~4 s/2 GiB).
        if self.device.type == "cpu":
            whole = zeroed_host_tensor((self.num_layers, *shape), self.dtype, setting)
            self.layers = list(whole.unbind(0))
            self.close()
            self._whole = whole  # the mapping the layers' views share; the prefaulter only refers to it weakly
            if prefault:
                self.prefaulter = KvPrefaulter(whole)  # faults the cache in while no step runs
                self.prefaulter.start()
        else:
            self.layers = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write of forked partial blocks (n > 1, beam search), before the forward pass."""
        if self.device.type == "cpu":
            # NOTE: one block slice per pair: advanced indexing of the [2, blocks, ...] views (cache[:, dst] =
            # cache[:, src]) took 10-30x as long on CPU (48 pairs x 30 layers: 0.5-2.2 s against 50-75 ms), and a
            # beam-search step forks that many (docs/benchmarks.md, "Beam search").
            for cache in self.layers:
                for s, d in pairs:
                    cache[:, d].copy_(cache[:, s])
            return
        src = torch.tensor([s for s, _ in pairs], device=self.device)
        dst = torch.tensor([d for _, d in pairs], device=self.device)
        for cache in self.layers:
            cache[:, dst] = cache[:, src]

    def close(self) -> None:
        if self.prefaulter is not None:
            self.prefaulter.close()
            self.prefaulter = None
