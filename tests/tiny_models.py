"""Small random-initialised models of every architecture in quantkit's table (cost nothing to build)."""

from __future__ import annotations

import torch
import transformers as T

COMMON = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=320,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)

CONFIGS = {
    "llama": lambda: T.LlamaConfig(**COMMON, tie_word_embeddings=True),
    "mistral": lambda: T.MistralConfig(**COMMON),
    "qwen2": lambda: T.Qwen2Config(**COMMON),
    "qwen3": lambda: T.Qwen3Config(**COMMON, head_dim=16),
    "gemma2": lambda: T.Gemma2Config(**COMMON, head_dim=16),
    "gemma3": lambda: T.Gemma3TextConfig(**COMMON, head_dim=16),
    "phi3": lambda: T.Phi3Config(**COMMON),
    "opt": lambda: T.OPTConfig(
        hidden_size=64,
        ffn_dim=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        vocab_size=320,
        word_embed_proj_dim=64,
        pad_token_id=1,
        bos_token_id=2,
        eos_token_id=2,
        enable_bias=True,
    ),
    "mixtral": lambda: T.MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": lambda: T.Qwen2MoeConfig(
        **COMMON,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=64,
        mlp_only_layers=[1],
    ),
    "qwen3_moe": lambda: T.Qwen3MoeConfig(
        **COMMON, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16
    ),
    # MLA with low-rank queries, one dense layer, then routed experts (grouped top-k) and a shared expert
    "deepseek_v3": lambda: T.DeepseekV3Config(
        **{**COMMON, "num_key_value_heads": 4},
        moe_intermediate_size=32,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        n_group=2,
        topk_group=1,
        first_k_dense_replace=1,
        q_lora_rank=48,
        kv_lora_rank=32,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=16,
    ),
}


def tiny_model(arch: str, seed: int = 0, dtype=torch.float32):
    torch.manual_seed(seed)
    config = CONFIGS[arch]()
    model = T.AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    with torch.no_grad():  # random norms so that folding tests see non-trivial weights
        for name, p in model.named_parameters():
            if "norm" in name and p.dim() == 1:
                p.copy_(torch.rand_like(p) * 0.5 + 0.75 if "gemma" not in arch else torch.rand_like(p) * 0.5 - 0.25)
    return model


def tiny_tokenizer(vocab_size: int = 320):
    """A byte-level BPE tokenizer trained in well under a second on the shipped calibration text."""
    from importlib import resources

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    text = resources.files("quantkit.calib_data").joinpath("brown_calib.txt").read_text()[:200_000]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", "<s>", "</s>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(text.splitlines(), trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def tiny_model_dir(path, arch: str = "llama", seed: int = 0):
    """Save a tiny random model of ``arch`` with a matching tokenizer as a Hugging Face folder."""
    model = tiny_model(arch, seed)
    model.save_pretrained(path)
    tiny_tokenizer(model.config.vocab_size).save_pretrained(path)
    return path


WORDS = [
    "the",
    "a",
    "of",
    "and",
    "to",
    "in",
    "is",
    "was",
    "he",
    "it",
    "that",
    "for",
    "on",
    "with",
    "as",
    "his",
    "at",
    "by",
]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m.role }}|> {{ m.content }} <|end|> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)


def word_tokenizer(adds_bos: bool, chat_template: str | None = None, bos_token: str | None = "<s>"):
    """A word-level tokenizer over :data:`WORDS` (whitespace-split; ids 0..6 are special), built offline in a
    millisecond. ``adds_bos``: a Llama-3 / Gemma style ``TemplateProcessing`` post-processor puts BOS in front of
    every text; ``chat_template``: a Jinja chat template (:data:`CHAT_TEMPLATE` renders BOS and role markers)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>", "<unk>", "<|user|>", "<|assistant|>", "<|end|>"]
    vocab = {t: i for i, t in enumerate([*specials, *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if adds_bos:
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", vocab["<s>"])]
        )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token=bos_token, eos_token="</s>", unk_token="<unk>"
    )
    tokenizer.add_special_tokens({"additional_special_tokens": specials[4:]})
    tokenizer.chat_template = chat_template
    return tokenizer
