"""Readable torch references for every kernel in this package: slow, obviously right, used by the tests.

Attention references gather each sequence's K/V token by token through its block table into contiguous tensors and
run plain softmax attention in fp32; they share no code with the kernels.
"""

from __future__ import annotations

import torch


def ref_store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """In place: `cache[slot // block_size, slot % block_size] = token` for every slot >= 0."""
    block_size = k_cache.shape[1]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        k_cache[slot // block_size, slot % block_size] = k[t]
        v_cache[slot // block_size, slot % block_size] = v[t]


def gather_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """A sequence's first `seq_len` cached tokens as contiguous `[seq_len, num_kv_heads, head_dim]` K and V."""
    block_size = k_cache.shape[1]
    blocks = block_table.tolist()
    idx = [(blocks[p // block_size], p % block_size) for p in range(seq_len)]
    k = torch.stack([k_cache[b, o] for b, o in idx]) if idx else k_cache[:0, 0]
    v = torch.stack([v_cache[b, o] for b, o in idx]) if idx else v_cache[:0, 0]
    return k, v


def ref_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, q_pos: torch.Tensor) -> torch.Tensor:
    """Softmax attention in fp32 with GQA: q `[n, H, D]` at absolute positions `q_pos`, k/v `[s, KVH, D]` at 0..s-1.

    Query i sees keys at positions <= q_pos[i]. Returns fp32 `[n, H, D]`.
    """
    group = q.shape[1] // k.shape[1]
    kf = k.float().repeat_interleave(group, dim=1)  # [s, H, D]
    vf = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,shd->hns", q.float(), kf) * scale
    visible = torch.arange(k.shape[0], device=q.device)[None, :] <= q_pos[:, None]  # [n, s]
    scores = scores.masked_fill(~visible[None], float("-inf"))
    return torch.einsum("hns,shd->nhd", scores.softmax(dim=-1), vf)


def ref_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """fp32 `[batch, H, D]`: each sequence's one query (the newest token) over its `seq_len` cached tokens."""
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for i, seq_len in enumerate(seq_lens.tolist()):
        if seq_len == 0:
            continue
        k, v = gather_kv(k_cache, v_cache, block_tables[i], seq_len)
        pos = torch.tensor([seq_len - 1], device=q.device)
        out[i] = ref_attention(q[i : i + 1], k, v, scale, pos)[0]
    return out


def ref_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """fp32 `[num_query_tokens, H, D]`: chunk c's queries sit at the last `qlen` positions of its `seq_len` context."""
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    starts = query_start_loc.tolist()
    for c, seq_len in enumerate(seq_lens.tolist()):
        lo, hi = starts[c], starts[c + 1]
        if hi == lo:
            continue
        k, v = gather_kv(k_cache, v_cache, block_tables[c], seq_len)
        pos = torch.arange(seq_len - (hi - lo), seq_len, device=q.device)
        out[lo:hi] = ref_attention(q[lo:hi], k, v, scale, pos)
    return out


def ref_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def ref_fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Out of place: `(rms_norm(x + residual), x + residual)`, the sum rounded to x's dtype as in HF."""
    summed = (x.float() + residual.float()).to(x.dtype)
    return ref_rms_norm(summed, weight, eps), summed


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def ref_rotary_neox(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Out of place, as HF Llama's `apply_rotary_pos_emb` (in fp32) on the first `2 * cos.shape[1]` dims."""
    rot = 2 * cos.shape[1]
    c = torch.cat((cos, cos), dim=-1)[positions].float()[:, None, :]  # [T, 1, rot]
    s = torch.cat((sin, sin), dim=-1)[positions].float()[:, None, :]

    def apply(x: torch.Tensor) -> torch.Tensor:
        xr, rest = x[..., :rot].float(), x[..., rot:]
        return torch.cat(((xr * c + rotate_half(xr) * s).to(x.dtype), rest), dim=-1)

    return apply(q), apply(k)


def ref_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(x.dtype)


def ref_gguf_decoded(w: torch.Tensor, kind: str) -> torch.Tensor:
    """`w` [N, K] quantized per block of 32 as llama.cpp's quantize_row_q4_1 / q8_0 do, then decoded as transformers'
    GGUF loader does (gguf-py: d * q + m in float32, d and m stored as f16): what `coded_pack` must recognise."""
    n, k = w.shape
    b = w.reshape(n, k // 32, 32)
    if kind == "q4_1":
        lo, hi = b.amin(-1, keepdim=True), b.amax(-1, keepdim=True)
        d = (hi - lo) / 15
        q = ((b - lo) * torch.where(d > 0, 1 / d, torch.zeros_like(d)) + 0.5).trunc().clamp(max=15)
        out = d.half().float() * q + lo.half().float()
    elif kind == "q8_0":
        d = b.abs().amax(-1, keepdim=True) / 127
        q = (b * torch.where(d > 0, 1 / d, torch.zeros_like(d))).round()
        out = d.half().float() * q
    else:
        raise ValueError(f"kind must be q4_1 or q8_0, not {kind!r}")
    return out.reshape(n, k)


def ref_coded_matmul(
    x: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor | None,
    group: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """`x @ W.T + bias` in fp32 with W decoded whole: `fma(scale, q, offset)` per `group` k, or per output channel
    (`group` 0) `(x @ q.T) * scale`; returned in x's dtype, the weight rounded to it first as the kernel's tile is."""
    q = codes.float()
    if group == 0:
        y = (x.float() @ q.to(x.dtype).float().T) * scales.float()
    else:
        d = scales.float().repeat_interleave(group, dim=1)
        w = d * q if offsets is None else torch.addcmul(offsets.float().repeat_interleave(group, dim=1), d, q)
        y = x.float() @ w.to(x.dtype).float().T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def ref_a8_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x `[M, K]` float32 as `coded_a8_linear` quantizes it per 32-k block: (codes `[M, K]` in -127..127, the scales
    `[M, K/32]` max|x| / 127, the blocks' float32 sums in the kernel's order: 4 vectors of 8 added pairwise, then
    their 8 lanes in turn)."""
    m, k = x.shape
    b = x.float().reshape(m, k // 32, 32)
    d = b.abs().amax(-1) / 127
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    q = torch.round(b * inv.unsqueeze(-1))  # half to even, as the kernel's conversion
    v = b.reshape(m, k // 32, 4, 8)
    lanes = (v[:, :, 0] + v[:, :, 1]) + (v[:, :, 2] + v[:, :, 3])
    s = torch.zeros(m, k // 32)
    for i in range(8):
        s = s + lanes[:, :, i]
    return q.reshape(m, k), d, s


def ref_coded_a8_matmul(
    x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`coded_a8_linear` in float64: per block, the exact integer dot product of x's 8-bit codes with the 4-bit
    weight codes (w = scale * q + offset per 32 k) times both scales, plus offset times the block's sum of x."""
    qa, da, sa = ref_a8_quantize(x)
    m, n = x.shape[0], codes.shape[0]
    dots = torch.einsum("mbk,nbk->mnb", qa.double().view(m, -1, 32), codes.double().view(n, -1, 32))
    y = (dots * (scales.double()[None] * da.double()[:, None]) + offsets.double()[None] * sa.double()[:, None]).sum(-1)
    return y if bias is None else y + bias.double()
