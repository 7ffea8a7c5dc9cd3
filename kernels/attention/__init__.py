"""Attention over the runtime's paged KV cache: decode (``paged``, flash-decoding over block tables, and the KV
store) and prefill (``prefill``, FlashAttention-2 tiling over packed chunks and their cached prefixes; chunks that
are draft trees are masked by the words ``tree_mask`` builds); ``mla``, DeepSeek's latent attention decode over paged
latent rows."""

from quantkit.kernels.attention.mla import mla_decode, mla_decode_reference, store_latent, store_latent_reference
from quantkit.kernels.attention.paged import (
    default_num_splits,
    gather_context,
    paged_decode,
    paged_decode_reference,
    store_kv,
    store_kv_reference,
)
from quantkit.kernels.attention.prefill import flash_prefill, flash_prefill_reference, prefill_config, tma_compatible
from quantkit.kernels.attention.tree_mask import CAUSAL_ROW, pack_tree_masks, tree_mask_words

__all__ = [
    "CAUSAL_ROW",
    "default_num_splits",
    "flash_prefill",
    "flash_prefill_reference",
    "gather_context",
    "mla_decode",
    "mla_decode_reference",
    "pack_tree_masks",
    "paged_decode",
    "paged_decode_reference",
    "prefill_config",
    "store_kv",
    "store_kv_reference",
    "store_latent",
    "store_latent_reference",
    "tma_compatible",
    "tree_mask_words",
]
