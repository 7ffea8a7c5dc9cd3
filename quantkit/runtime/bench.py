"""Offline serving measurements: a seeded random workload, and the engine's throughput and KV waste on it.

Used by ``quantkit bench-serve`` and ``benchmarks/bench_serve.py``. Model shapes for random-weight ("dummy")
benchmarks are named here, so a GPU with no real model can still measure real-sized work.
"""

from __future__ import annotations

import sys
import time
from dataclasses import asdict, dataclass, field

import torch
from triton.runtime.jit import JITFunction

from quantkit.runtime.engine import LLM
from quantkit.runtime.sampling_params import SamplingParams

DUMMY_MODELS = {
    "llama-3-8b": dict(
        model_type="llama",
        architectures=["LlamaForCausalLM"],
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        tie_word_embeddings=False,
        bos_token_id=128000,
        eos_token_id=128001,
        dtype="bfloat16",
    ),
    "mixtral-8x7b": dict(  # 46.7B parameters, 12.9B active per token (2 of 8 experts)
        model_type="mixtral",
        architectures=["MixtralForCausalLM"],
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        num_local_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=32768,
        rms_norm_eps=1e-5,
        rope_theta=1000000.0,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        dtype="bfloat16",
    ),
    "qwen3-30b-a3b": dict(  # 30.5B parameters, 3.3B active per token (8 of 128 experts)
        model_type="qwen3_moe",
        architectures=["Qwen3MoeForCausalLM"],
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        tie_word_embeddings=False,
        bos_token_id=151643,
        eos_token_id=151645,
        dtype="bfloat16",
    ),
    "deepseek-v3-tiny": dict(  # DeepSeek-V3's attention (MLA: 576-value latent rows) and router, scaled to one GPU
        model_type="deepseek_v3",
        architectures=["DeepseekV3ForCausalLM"],
        vocab_size=129280,
        hidden_size=2048,
        intermediate_size=10944,
        moe_intermediate_size=1408,
        num_hidden_layers=12,
        first_k_dense_replace=1,
        num_attention_heads=16,
        num_key_value_heads=16,
        q_lora_rank=768,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        qk_nope_head_dim=128,
        v_head_dim=128,
        n_routed_experts=64,
        num_experts_per_tok=8,
        n_group=8,
        topk_group=4,
        n_shared_experts=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        num_nextn_predict_layers=1,
        max_position_embeddings=16384,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
        dtype="bfloat16",
    ),
    "tiny-qwen3-moe": dict(  # the CPU smoke test of MoE serving
        model_type="qwen3_moe",
        architectures=["Qwen3MoeForCausalLM"],
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        eos_token_id=2,
    ),
    "tiny-llama": dict(
        model_type="llama",
        architectures=["LlamaForCausalLM"],
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        eos_token_id=2,
    ),
}


@dataclass
class Throughput:
    requests: int
    prompt_tokens: int
    output_tokens: int
    seconds: float
    steps: int
    preemptions: int
    kv_waste: float  # fraction of allocated KV slots holding nothing, averaged over steps
    compiled: list[str] = field(default_factory=list)  # Triton kernels compiled inside the timed run, as
    # "name: specialization key" (its time includes them: should be none)

    @property
    def compiles(self) -> int:
        return len(self.compiled)

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def total_tok_s(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.seconds

    def to_dict(self) -> dict:
        return {**asdict(self), "compiles": self.compiles, "output_tok_s": self.output_tok_s,
                "total_tok_s": self.total_tok_s}  # fmt: skip


def random_workload(num_requests: int, min_len: int, max_len: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """Prompts of uniform random length in [min_len, max_len] made of uniform random token ids (>= 3)."""
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(min_len, max_len + 1, (num_requests,), generator=gen).tolist()
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lens]


def compiled_kernels() -> set[str]:
    """Triton kernels compiled so far in this process by quantkit's kernel modules (every device and
    specialization), as "name: specialization key": the difference across a timed run tells whether a compile
    landed inside it, and which."""
    found = set()
    for name, module in list(sys.modules.items()):
        if name.startswith("quantkit.kernels.") and module is not None:
            for obj in vars(module).values():
                if isinstance(obj, JITFunction):
                    found.update(f"{obj.__name__}: {key}" for cache in obj.device_caches.values() for key in cache[0])
    return found


def kernel_names(compiled: list[str]) -> str:
    """The kernel names of ``Throughput.compiled`` entries, each once, comma-separated."""
    return ", ".join(sorted({c.split(":")[0] for c in compiled}))


def _sync(llm: LLM) -> None:
    if llm.device.type == "cuda":
        torch.cuda.synchronize(llm.device)


# Prompt lengths of the warm-up: one eager step per M range of the W4A16 / W8A8 config tables, none a multiple of 16
# (Triton compiles those and the others separately; the engine's start-up already ran a full-budget step and every
# CUDA-graph batch size), so that no kernel is compiled inside a timed run. A timed run whose mixed prefill + decode
# steps first met a ragged M > 256 paid the compile there: one int8 W8A8 run measured 5,109 instead of ~11,000
# tok/s (docs/results/serve.md).
WARM_UP_LENGTHS = (3, 8, 17, 40, 100, 200, 300, 1000)
WARM_UP_BATCH = 17  # then this many prompts at once, more tokens than one step takes: several sequences per
# kernel launch and steps that mix chunked prefills with decodes, like the timed run's


def warm_up(llm: LLM, seed: int = 12345, full: bool | None = None) -> None:
    """Compile every kernel the runtime's eager steps may launch before anything is timed: one short generation per
    ``WARM_UP_LENGTHS``, then ``WARM_UP_BATCH`` prompts together, then (where they fit) ``long_chunk_prompts``. The
    prompts are random tokens of their own (no timed prompt can then start with a block that the warm-up left in
    the prefix cache), each capped so that it and its 2 new tokens fit the model length and the whole KV cache.
    ``full`` (default: on CUDA only): off CUDA nothing is compiled (PyTorch kernels, or Triton's interpreter), so
    one short prompt warms up the rest there, without the cost of the whole sequence on a CPU."""
    cache_tokens = llm.runner.num_blocks * llm.runner.block_size
    longest = min(max(WARM_UP_LENGTHS), llm.max_model_len, cache_tokens) - 2
    gen = torch.Generator().manual_seed(seed)
    vocab = llm.model.config.vocab_size

    def prompt(n: int) -> list[int]:
        return torch.randint(3, vocab, (n,), generator=gen).tolist()

    params = SamplingParams(max_tokens=2, ignore_eos=True)
    if not (llm.device.type == "cuda" if full is None else full):
        llm.generate([prompt(min(WARM_UP_LENGTHS[1], longest))], params)
        return
    for n in sorted({min(n, longest) for n in WARM_UP_LENGTHS}):
        llm.generate([prompt(n)], params)
    per_prompt = min(longest, -(-llm.config.max_num_batched_tokens // (WARM_UP_BATCH - 1)) | 1)  # odd: ragged
    llm.generate([prompt(per_prompt) for _ in range(WARM_UP_BATCH)], params)
    lengths = long_chunk_prompts(llm.config.max_num_batched_tokens, longest, llm.max_model_len, cache_tokens,
                                 llm.config.max_num_seqs)  # fmt: skip
    if lengths:
        llm.generate([prompt(n) for n in lengths], params)


def long_chunk_prompts(budget: int, longest: int, max_model_len: int, cache_tokens: int, max_seqs: int):
    """Prompt lengths whose prefill makes a chunk of more than the small prefill tiles' limit after cached context
    (``attention.prefill.PREFILL_CONFIGS``), the chunk a preempted sequence's recomputation runs: fillers (each at
    most ``longest``) take all of one step's ``budget`` but the long prompt's first chunk, and its second chunk, in
    the next step, is the rest. None where the model length, the cache or the step limits leave no room for it (on
    Qwen3-30B-A3B's shape a timed bf16 run compiled that variant after 60 preemptions, docs/results/serve.md)."""
    from quantkit.kernels.attention.prefill import PREFILL_CONFIGS

    long_len = min(max_model_len, cache_tokens) - 2
    first = long_len - (PREFILL_CONFIGS[0][0] + 1)
    fill = budget - first
    if first < 1 or fill < 0 or longest < 1:
        return None
    n = -(-fill // longest)
    fillers = [fill // n + (i < fill % n) for i in range(n)] if n else []
    if n + 1 > max_seqs or fill + long_len + 2 * (n + 1) > cache_tokens:
        return None
    return [*fillers, long_len]


def offline_throughput(llm: LLM, prompts: list[list[int]], output_len: int) -> tuple[Throughput, list[list[int]]]:
    """Generate ``output_len`` tokens for every prompt (EOS ignored, greedy), all submitted at once; returns the
    measurement and the generated tokens. ``warm_up`` first compiles the kernels outside the timing."""
    warm_up(llm)
    if llm.spec is not None:  # count the timed run's speculation only
        llm.spec.totals = type(llm.spec.totals)()
    preemptions, steps0, allocated0, used0 = (
        llm.scheduler.num_preemptions, llm.stats.steps, llm.stats.allocated_slots, llm.stats.used_slots
    )  # fmt: skip
    _sync(llm)
    compiled = compiled_kernels()
    start = time.perf_counter()
    outputs = llm.generate(prompts, SamplingParams(max_tokens=output_len, ignore_eos=True))
    _sync(llm)
    seconds = time.perf_counter() - start
    compiles = sorted(compiled_kernels() - compiled)
    allocated = llm.stats.allocated_slots - allocated0
    used = llm.stats.used_slots - used0
    tokens = [o.outputs[0].token_ids for o in outputs]
    result = Throughput(
        requests=len(prompts),
        prompt_tokens=sum(map(len, prompts)),
        output_tokens=sum(map(len, tokens)),
        seconds=seconds,
        steps=llm.stats.steps - steps0,
        preemptions=llm.scheduler.num_preemptions - preemptions,
        kv_waste=1.0 - used / allocated if allocated else 0.0,
        compiled=compiles,
    )
    return result, tokens


def hf_from_runtime(model, config: dict):
    """transformers' model of ``config`` (a ``DUMMY_MODELS`` entry) holding the runtime ``model``'s own float
    weights, not copies where the layouts allow: fused q/k/v and gate/up weights are split into views, stacked
    experts (the fused MoE kernels' float layout) are transformers 5's ``experts.gate_up_proj`` [E, 2I, H] and
    ``experts.down_proj`` [E, H, I] as they are; per-expert weights (unfused, as on the CPU) are stacked, a copy.
    So an HF baseline of a model that fills the GPU can run on the very weights the runtime served."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from quantkit.runtime.model import head_dim

    hf_config = AutoConfig.for_model(**config)
    weight = next(p for p in model.parameters() if p.is_floating_point())
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(hf_config, dtype=weight.dtype, attn_implementation="sdpa")
    hd = head_dim(hf_config)
    qkv = [hf_config.num_attention_heads * hd] + [hf_config.num_key_value_heads * hd] * 2
    tensors, experts = {}, {}
    named = []
    for name, t in model.state_dict().items():
        prefix, _, leaf = name.rpartition(".")
        if prefix.endswith(".qkv_proj"):
            parts = zip(("q_proj", "k_proj", "v_proj"), t.split(qkv), strict=True)
            named += [(f"{prefix.removesuffix('qkv_proj')}{part}.{leaf}", w) for part, w in parts]
        elif prefix.endswith(".gate_up_proj"):
            parts = zip(("gate_proj", "up_proj"), t.chunk(2), strict=True)
            named += [(f"{prefix.removesuffix('gate_up_proj')}{part}.{leaf}", w) for part, w in parts]
        else:
            named.append((name, t))
    for name, t in named:
        if ".experts." in name:  # model.layers.{i}.mlp.experts.{e}.{proj}.weight
            block, _, rest = name.partition(".experts.")
            e, proj = rest.split(".")[:2]
            experts.setdefault(block, {}).setdefault(proj, {})[int(e)] = t
        else:
            tensors[name] = t
    for block, projs in experts.items():
        order = sorted(projs["gate_proj"])
        tensors[f"{block}.experts.gate_up_proj"] = torch.stack(
            [torch.cat([projs["gate_proj"][e], projs["up_proj"][e]]) for e in order]
        )
        tensors[f"{block}.experts.down_proj"] = torch.stack([projs["down_proj"][e] for e in order])
    for i, layer in enumerate(model.model.layers):
        fused = getattr(layer.mlp, "fused", None)
        if fused is not None:
            if fused[0].fmt != "float":
                raise ValueError(f"layer {i}: {fused[0].fmt} experts have no transformers float layout")
            tensors[f"model.layers.{i}.mlp.experts.gate_up_proj"] = fused[0].weight
            tensors[f"model.layers.{i}.mlp.experts.down_proj"] = fused[1].weight
    expected = hf.state_dict()
    missing, unexpected = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise ValueError(
            f"runtime weights do not match transformers': missing {missing[:3]}, unexpected {unexpected[:3]}"
        )
    for name, t in expected.items():
        if tensors[name].shape != t.shape:
            raise ValueError(f"{name}: runtime {tuple(tensors[name].shape)}, transformers {tuple(t.shape)}")
    hf.load_state_dict(tensors, assign=True, strict=True)
    rotary = hf.model.rotary_emb  # non-persistent buffers, computed at construction: built again on the device
    hf.model.rotary_emb = type(rotary)(hf_config).to(weight.device)
    left = [n for n, t in [*hf.named_parameters(), *hf.named_buffers()] if t.is_meta]
    if left:
        raise ValueError(f"transformers' model has tensors the runtime does not: {left[:3]}")
    hf.eval().requires_grad_(False)
    hf.generation_config.eos_token_id = None  # EOS disabled for every benchmark run
    return hf
