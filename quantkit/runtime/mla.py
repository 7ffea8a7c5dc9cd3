"""Multi-head latent attention (MLA: DeepSeek-V2 section 2.1, DeepSeek-V3) over a paged cache of the compressed latent.

Per token and layer the cache holds one row of ``kv_lora_rank + qk_rope_head_dim`` values: the normalised latent
c = kv_a_layernorm(kv_a_proj_with_mqa(x)[:kv_lora_rank]) and the rotated key k_pe shared by all heads. The heads'
keys and values are never stored (DeepSeek-V3: 576 values per token instead of 128 heads x (192 + 128)):

- prefill chunks decompress their context through ``kv_b_proj`` (k = [W_UK c, k_pe], v = W_UV c per head) and
  attend as transformers does: SDPA over the concatenated 192-wide q and k;
- decodes absorb ``kv_b_proj`` into the query and the output (the paper's "absorbed" form): q_lat[h] = W_UK[h]^T
  q_nope[h], scores q_lat . c + q_pe . k_pe, o[h] = W_UV[h] (sum_j p_j c_j), so a decode reads only the latent rows.

Prefill runs in plain PyTorch; decode runs ``quantkit.kernels.attention.mla`` (a Triton flash-decoding kernel over the
latent rows; its ``mla_decode_reference`` with the ``torch`` backend). The cache is one tensor per layer
[num_blocks, block_size, 1, kv_lora_rank + qk_rope_head_dim] (``CausalLM.kv_layout``). The projections and norms
have transformers' names (``q_a_proj``, ``q_a_layernorm``, ``q_b_proj`` or ``q_proj`` without ``q_lora_rank``,
``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``, ``o_proj``), so float and quantized checkpoints load alike.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from quantkit.kernels.attention.mla import mla_decode, mla_decode_reference, store_latent, store_latent_reference
from quantkit.kernels.attention.paged import gather_context
from quantkit.kernels.attention.tree_mask import tree_mask_dense

LORA_NORM_EPS = 1e-6  # transformers builds q_a_layernorm / kv_a_layernorm with the default eps, not rms_norm_eps


def softmax_scale(config) -> float:
    """qk_head_dim ** -0.5, times YaRN's mscale(mscale_all_dim) squared when the rope is scaled (DeepSeek's
    reference code; transformers 5.2x computes the same in ``yarn_apply_mscale``, which older versions lack)."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    rope_type = params.get("rope_type", params.get("type", "default"))
    mscale_all_dim = params.get("mscale_all_dim", 0)
    if rope_type != "default" and mscale_all_dim:
        mscale = yarn_mscale(params["factor"], mscale_all_dim)
        scale = scale * mscale * mscale
    return scale


def yarn_mscale(factor: float, mscale: float) -> float:
    """YaRN's attention temperature for a context extended ``factor`` times: 0.1 * mscale * ln(factor) + 1."""
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """x [T, H, D]; cos/sin [T, D] (``cat(freqs, freqs)`` tables). ``interleave``: DeepSeek's pairs (x0, x1), (x2,
    x3) ... rotated and written out de-interleaved (first elements, then second ones), as transformers does."""
    half = x.shape[-1] // 2
    if interleave:
        c, s = cos[:, None, :half], sin[:, None, :half]
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    c, s = cos[:, None, :], sin[:, None, :]
    return x * c + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * s


class MLAttention(nn.Module):
    """``forward(x [T, hidden], cos, sin, meta, (latent_cache,)) -> [T, hidden]`` over the paged latent cache;
    ``forward_dense`` attends over a dense per-sequence latent history instead (the MTP drafter's)."""

    def __init__(self, config, prefix: str, linear: Callable, norm: Callable[[int, float], nn.Module]):
        super().__init__()
        hidden, heads = config.hidden_size, config.num_attention_heads
        self.num_heads, self.rank = heads, config.kv_lora_rank
        self.nope, self.rope_dim, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.latent_width = self.rank + self.rope_dim
        self.scale = softmax_scale(config)
        self.interleave = bool(getattr(config, "rope_interleave", False))
        bias = bool(getattr(config, "attention_bias", False))
        qk = self.nope + self.rope_dim
        if config.q_lora_rank is None:
            self.q_proj = linear(f"{prefix}.q_proj", hidden, heads * qk, False)
        else:
            self.q_a_proj = linear(f"{prefix}.q_a_proj", hidden, config.q_lora_rank, bias)
            self.q_a_layernorm = norm(config.q_lora_rank, LORA_NORM_EPS)
            self.q_b_proj = linear(f"{prefix}.q_b_proj", config.q_lora_rank, heads * qk, False)
        self.kv_a_proj_with_mqa = linear(f"{prefix}.kv_a_proj_with_mqa", hidden, self.latent_width, bias)
        self.kv_a_layernorm = norm(self.rank, LORA_NORM_EPS)
        self.kv_b_proj = linear(f"{prefix}.kv_b_proj", self.rank, heads * (self.nope + self.v_dim), False)
        self.o_proj = linear(f"{prefix}.o_proj", heads * self.v_dim, hidden, bias)
        self._absorbed: torch.Tensor | None = None  # a quantized kv_b_proj's weight, dequantized

    # -- projections -----------------------------------------------------------------------------------------------

    def project(self, x, cos, sin) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (q_nope [T, H, nope], rotated q_pe [T, H, rope], latent rows [T, rank + rope])."""
        t = x.shape[0]
        q = self.q_proj(x) if hasattr(self, "q_proj") else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_pe = q.view(t, self.num_heads, -1).split((self.nope, self.rope_dim), dim=-1)
        c, k_pe = self.kv_a_proj_with_mqa(x).split((self.rank, self.rope_dim), dim=-1)
        q_pe = rope(q_pe, cos, sin, self.interleave)
        k_pe = rope(k_pe[:, None], cos, sin, self.interleave)[:, 0]
        return q_nope, q_pe, torch.cat((self.kv_a_layernorm(c), k_pe), dim=-1)

    def absorbed_weights(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK [H, nope, rank], W_UV [H, v, rank]): views of kv_b_proj's weight per head (a quantized one
        dequantized to ``dtype`` once, on first use: as many bytes as the float weight)."""
        kv_b = self.kv_b_proj
        if not hasattr(kv_b, "dequantize_weight"):
            w = kv_b.weight
        else:
            if self._absorbed is None:
                self._absorbed = kv_b.dequantize_weight(dtype)
            w = self._absorbed
        w = w.view(self.num_heads, self.nope + self.v_dim, self.rank)
        return w[:, : self.nope], w[:, self.nope :]

    def decompress(self, latents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """latent rows [S, rank + rope] -> (k [S, H, nope + rope], v [S, H, v]) as transformers' ``expand_kv``."""
        s = latents.shape[0]
        c, k_pe = latents.split((self.rank, self.rope_dim), dim=-1)
        k_nope, v = self.kv_b_proj(c).view(s, self.num_heads, -1).split((self.nope, self.v_dim), dim=-1)
        return torch.cat((k_nope, k_pe[:, None].expand(s, self.num_heads, self.rope_dim)), dim=-1), v

    def attend(self, q_nope, q_pe, latents, allowed) -> torch.Tensor:
        """Decompressed attention of q [T, H, *] over latent rows [S, *] where ``allowed`` [T, S] -> [T, H, v].
        PyTorch's SDPA (transformers' default for this model): on CUDA a memory-efficient kernel, so a long prompt
        never holds its [H, T, S] scores."""
        k, v = self.decompress(latents.to(q_nope.dtype))
        q = torch.cat((q_nope, q_pe), dim=-1)
        q, k, v = (t.transpose(0, 1)[None] for t in (q, k, v))  # [1, H, T or S, *]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=self.scale)[0].transpose(0, 1)

    # -- paged steps -----------------------------------------------------------------------------------------------

    def forward(self, x, cos, sin, meta, kv_cache: tuple[torch.Tensor, ...]) -> torch.Tensor:
        cache = kv_cache[0]  # [blocks, block_size, 1, rank + rope]
        t = x.shape[0]
        q_nope, q_pe, latent = self.project(x, cos, sin)
        store = store_latent if meta.backend == "triton" else store_latent_reference
        store(latent, cache, meta.slot_mapping)
        nd, parts = meta.num_decodes, []
        if nd:
            parts.append(self._decode(q_nope[:nd], q_pe[:nd], cache, meta))
        if meta.has_prefill:
            parts.append(self._prefill(q_nope[nd:], q_pe[nd:], cache, meta))
        o = parts[0] if len(parts) == 1 else torch.cat(parts)
        return self.o_proj(o.reshape(t, self.num_heads * self.v_dim))

    def _decode(self, q_nope, q_pe, cache, meta) -> torch.Tensor:
        w_uk, w_uv = self.absorbed_weights(q_nope.dtype)
        q_lat = torch.einsum("bhn,hnr->bhr", q_nope, w_uk.to(q_nope.dtype))  # [B, H, rank]
        args = (q_lat, q_pe, cache, meta.decode_block_tables, meta.decode_context_lens, self.scale)
        if meta.backend == "triton":
            o_lat = mla_decode(*args, num_splits=meta.decode_num_splits, max_context=meta.max_decode_context or None)
        else:
            o_lat = mla_decode_reference(*args)
        return torch.einsum("bhr,hvr->bhv", o_lat.to(q_nope.dtype), w_uv.to(q_nope.dtype))

    def _prefill(self, q_nope, q_pe, cache, meta) -> torch.Tensor:
        out = q_nope.new_empty(q_nope.shape[0], self.num_heads, self.v_dim)
        cu = meta.prefill_cu_seqlens.tolist()
        for n, kv_len in enumerate(meta.prefill_context_lens.tolist()):
            rows, q_len = slice(cu[n], cu[n + 1]), cu[n + 1] - cu[n]
            if q_len == 0:
                continue
            latents = gather_context(cache, meta.prefill_block_tables[n], 0, kv_len)[:, 0]
            allowed = causal(kv_len - q_len, q_len, q_nope.device)
            if meta.prefill_tree_mask is not None:
                allowed[:, kv_len - q_len :] &= tree_mask_dense(meta.prefill_tree_mask[rows], q_len)
            out[rows] = self.attend(q_nope[rows], q_pe[rows], latents, allowed)
        return out

    # -- dense history (MTP drafting) ------------------------------------------------------------------------------

    def forward_dense(self, x, cos, sin, past: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """One sequence's new tokens x [T, hidden] after the latent rows ``past`` [S0, rank + rope] (None: none) ->
        (output [T, hidden], latent rows [S0 + T, rank + rope])."""
        t = x.shape[0]
        q_nope, q_pe, latent = self.project(x, cos, sin)
        latents = latent if past is None else torch.cat((past, latent))
        o = self.attend(q_nope, q_pe, latents, causal(latents.shape[0] - t, t, x.device))
        return self.o_proj(o.reshape(t, self.num_heads * self.v_dim)), latents


def causal(prefix: int, q_len: int, device) -> torch.Tensor:
    """bool [q_len, prefix + q_len]: query i (at position prefix + i) sees keys 0 .. prefix + i."""
    k_pos = torch.arange(prefix + q_len, device=device)[None, :]
    return k_pos <= torch.arange(prefix, prefix + q_len, device=device)[:, None]
