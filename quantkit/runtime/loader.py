"""Build the runtime's model from a float HF folder, a quantkit checkpoint, an HF model in memory, or a config
with random ("dummy") weights.

The model is built on the meta device, its linears made by a factory (``FloatLinear``, or the quantized module the
checkpoint declares for that name), then filled with ``load_state_dict(assign=True)`` from the safetensors files,
so no weight is allocated twice.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from quantkit.errors import QuantkitError, one_line
from quantkit.quant.scheme import QuantScheme
from quantkit.runtime.model import CausalLM, FloatLinear, RMSNorm
from quantkit.runtime.moe import experts_by_name

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
IGNORED_KEY_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass
class LoadedModel:
    model: CausalLM
    tokenizer: object | None
    eos_token_ids: tuple[int, ...]


def resolve_dtype(name: str, config, device: torch.device) -> torch.dtype:
    if name != "auto":
        return DTYPES[name]
    if device.type != "cuda":
        return torch.float32
    stored = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    stored = DTYPES.get(stored, stored) if isinstance(stored, str) else stored
    return stored if stored in (torch.float16, torch.bfloat16) else torch.bfloat16


def eos_ids(*sources) -> tuple[int, ...]:
    """EOS ids from the first source (generation config, then model config) that names any."""
    for src in sources:
        eos = getattr(src, "eos_token_id", None) if not isinstance(src, dict) else src.get("eos_token_id")
        if eos is not None:
            return tuple(eos) if isinstance(eos, list | tuple) else (int(eos),)
    return ()


def float_linear(dtype):
    return lambda name, n_in, n_out, bias: FloatLinear(n_in, n_out, bias=bias, dtype=dtype)


def quantized_linear(schemes: dict, dtype):
    """Linears of the names a quantkit checkpoint lists are built empty for their scheme; the rest stay float."""
    from quantkit.nn.factory import empty_quantized_linear

    def make(name, n_in, n_out, bias):
        if name in schemes:
            return empty_quantized_linear(n_in, n_out, schemes[name], bias, dtype)
        return FloatLinear(n_in, n_out, bias=bias, dtype=dtype)

    return make


def assign_weights(model: CausalLM, tensors: dict[str, torch.Tensor], device: torch.device, where="") -> None:
    """Fill every meta parameter/buffer of ``model`` from ``tensors`` (cast to the dtype the module declares; MoE
    experts under any of the names ``moe.experts_by_name`` reads)."""
    expected = {k: v for k, v in model.state_dict().items() if v.is_meta}
    tensors = {k: v for k, v in experts_by_name(tensors).items() if not k.endswith(IGNORED_KEY_SUFFIXES)}
    if model.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(model.state_dict()))
    if missing or unexpected:
        raise QuantkitError(f"checkpoint does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    for k, t in expected.items():
        if tuple(tensors[k].shape) != tuple(t.shape):
            raise QuantkitError(f"checkpoint tensor {k} has shape {tuple(tensors[k].shape)}, expected {tuple(t.shape)}")
    from quantkit.checkpoint.read import SAFETENSORS_DTYPES, check_quantized_tensors

    stored = {k: SAFETENSORS_DTYPES.get(v.dtype, str(v.dtype)) for k, v in tensors.items()}
    model.load_state_dict({k: tensors[k].to(device=device, dtype=t.dtype) for k, t in expected.items()}, assign=True,
                          strict=False)  # fmt: skip
    check_quantized_tensors(where, model, stored)


def load_folder(path: str | Path, dtype_name: str, device: torch.device, mtp: bool = False) -> LoadedModel:
    """A float HF folder or a quantkit checkpoint folder. Multi-token-prediction layers past the last decoder layer
    (DeepSeek-V3's, ``checkpoint.mtp``) are left out, or with ``mtp`` built as ``model.mtp_layers`` (a list of
    ``speculative.mtp.MTPLayer``, float or quantized as the checkpoint stores them) for MTP drafting."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    from quantkit.models.loading import loading, read_config

    folder = Path(path)
    raw = read_config(folder)
    with loading(folder):
        config = AutoConfig.from_pretrained(folder)
    dtype = resolve_dtype(dtype_name, config, device)
    if mtp:  # refused before any weight is read
        from quantkit.checkpoint.mtp import mtp_layers
        from quantkit.checkpoint.read import tensor_headers
        from quantkit.runtime.speculative.mtp import no_mtp_layers

        if not mtp_layers(raw, tensor_headers(folder)):
            raise no_mtp_layers(config)
    qc = raw.get("quantization_config")
    if qc is None:
        linear = float_linear(dtype)
    else:
        from quantkit.checkpoint.config import module_schemes

        schemes = module_schemes(qc)
        linear = quantized_linear(schemes, dtype)
    with loading(folder), torch.device("meta"):
        model = CausalLM(config, linear, dtype)
    if qc is not None:
        names = {name for name, _ in model.named_modules()}
        absent = sorted(set(schemes) - names)
        if absent:
            raise QuantkitError(f"corrupt checkpoint {folder}: quantized module {absent[0]} is not in the model")
    from quantkit.checkpoint.mtp import split_mtp
    from quantkit.checkpoint.read import read_tensors

    with loading(folder):
        tensors = read_tensors(folder)
        mtp_layers, mtp_tensors = split_mtp(raw, tensors)
        assign_weights(model, tensors, device, folder)
        if mtp and mtp_layers:
            from quantkit.checkpoint.mtp import mtp_schemes
            from quantkit.runtime.speculative.mtp import build_mtp

            mtp_linear = quantized_linear(mtp_schemes(qc), dtype) if qc is not None else linear
            model.mtp_layers = build_mtp(config, mtp_layers, mtp_tensors, mtp_linear, dtype, device)
        tokenizer = None
        if (folder / "tokenizer.json").is_file() or (folder / "tokenizer_config.json").is_file():
            tokenizer = AutoTokenizer.from_pretrained(folder)
        gen = GenerationConfig.from_pretrained(folder) if (folder / "generation_config.json").is_file() else None
    return LoadedModel(model, tokenizer, eos_ids(gen, config))


def from_hf_model(hf_model: nn.Module, device: torch.device, tokenizer=None) -> LoadedModel:
    """Adopt a loaded HF model's modules (float or quantized) and weights: shared, not copied (transformers' fused
    3-D expert weights are split into per-expert views)."""
    config = hf_model.config
    modules = dict(hf_model.named_modules())
    dtype = next(p for p in hf_model.parameters() if p.is_floating_point()).dtype
    tensors = experts_by_name(dict(hf_model.state_dict()))

    def adopt(name, n_in, n_out, bias):
        mod = modules.get(name)
        if mod is None and f"{name}.weight" in tensors:  # one expert's projection of a fused experts tensor
            return FloatLinear(n_in, n_out, bias=False, dtype=tensors[f"{name}.weight"].dtype)
        if mod is None or (getattr(mod, "in_features", None), getattr(mod, "out_features", None)) != (n_in, n_out):
            raise QuantkitError(f"HF model has no linear {name} of shape [{n_out}, {n_in}]")
        if type(mod) is nn.Linear:  # a meta FloatLinear, given the HF weights (the same tensors) by assign_weights
            return FloatLinear(n_in, n_out, bias=mod.bias is not None, dtype=mod.weight.dtype)
        return mod

    with torch.device("meta"):
        model = CausalLM(config, adopt, dtype)
    assign_weights(model, tensors, device)
    model.to(device)
    return LoadedModel(model, tokenizer, eos_ids(getattr(hf_model, "generation_config", None), config))


def dummy(
    config, dtype_name: str, device: torch.device, seed: int = 0, mtp: bool = False, scheme: QuantScheme | None = None
) -> LoadedModel:
    """Random weights in the shape of ``config`` (an HF config or a dict with ``model_type``), for benchmarks; with
    ``mtp``, one random MTP layer when the config declares ``num_nextn_predict_layers``. With ``scheme`` (integer
    weight-only, 2, 4 or 8 bits), every decoder-layer linear is made quantized directly, never as a float weight:
    uniform random codes, the zero point at mid-range, scales giving the float initialisation's standard deviation
    (the lm_head, embedding and routers stay float). Each MoE layer's float experts are views of one gate/up
    [E, 2I, H] and one down [E, H, I] tensor (the fused kernels' layout: stacking them copies one layer at a time
    and frees the layer whole)."""
    if isinstance(config, dict):
        from transformers import AutoConfig

        try:
            config = AutoConfig.for_model(**config)
        except Exception as exc:  # an unknown model_type, a malformed field: transformers' own checks
            raise QuantkitError(f"cannot build a model from this config: {one_line(exc)}") from None
    dtype = resolve_dtype(dtype_name, config, device)
    linear = float_linear(dtype) if scheme is None else random_quantized_linear(scheme, dtype)
    with torch.device("meta"):
        model = CausalLM(config, linear, dtype)
    gen = torch.Generator(device).manual_seed(seed)
    std = getattr(config, "initializer_range", 0.02)
    views = _stacked_expert_views(model, device, gen, std)
    for mod in model.modules():
        if mod not in views:
            mod.to_empty(device=device, recurse=False)
    with torch.no_grad():
        for buf in model.buffers():  # DeepSeek-V3's router correction bias (quantized buffers are filled below)
            buf.zero_()
        for mod in model.modules():
            if isinstance(mod, RMSNorm):
                mod.weight.fill_(1.0)
            elif isinstance(mod, nn.Linear | nn.Embedding) and mod not in views:
                mod.weight.normal_(0.0, std, generator=gen)
            if getattr(mod, "qweight", None) is not None:
                _random_codes(mod, std, gen)
            elif isinstance(getattr(mod, "bias", None), torch.Tensor):
                mod.bias.zero_()
    if mtp and getattr(config, "num_nextn_predict_layers", 0):
        from quantkit.runtime.speculative.mtp import random_mtp

        model.mtp_layers = random_mtp(config, float_linear(dtype), dtype, device, gen)
    return LoadedModel(model, None, eos_ids(config))


def random_quantized_linear(scheme: QuantScheme, dtype):
    """``dummy``'s factory: decoder-layer linears empty quantized layers of ``scheme``, the rest float."""
    if not scheme.weight_only or scheme.fmt != "int" or 32 % scheme.bits:
        raise QuantkitError(f"random quantized weights are integer weight-only of 2, 4 or 8 bits, got {scheme.name}")
    from quantkit.nn.factory import empty_quantized_linear

    def make(name, n_in, n_out, bias):
        if name.startswith("model.layers."):
            return empty_quantized_linear(n_in, n_out, scheme, bias, dtype)
        return FloatLinear(n_in, n_out, bias=bias, dtype=dtype)

    return make


def _random_codes(mod: nn.Module, std: float, gen: torch.Generator) -> None:
    """Fill a meta-built GPTQ-v2 ``QuantLinear``: random packed codes, zero points 2**(b-1), scales s with
    s * std(codes) = ``std``, groups contiguous along K."""
    b, group = mod.scheme.bits, mod.scheme.group_size
    info = torch.iinfo(torch.int32)
    mod.qweight.random_(info.min, info.max, generator=gen)  # every b-bit field uniform
    word = sum((1 << (b - 1)) << (b * i) for i in range(32 // b))
    mod.qzeros.fill_(word - (1 << 32) if word > info.max else word)  # int32's two's complement
    mod.scales.fill_(std / (((1 << (2 * b)) - 1) / 12) ** 0.5)
    k = torch.arange(mod.in_features, device=mod.g_idx.device)
    mod.g_idx.copy_(k // group if group > 0 else torch.zeros_like(k))
    if mod.bias is not None:
        mod.bias.zero_()


def _stacked_expert_views(model: CausalLM, device, gen: torch.Generator, std: float) -> set[nn.Module]:
    """Give every MoE layer's float experts views of two stacked tensors, filled at random; returns the linears
    (and experts) so made."""
    from quantkit.runtime.moe import SparseMoE

    made: set[nn.Module] = set()
    for block in model.modules():
        if not isinstance(block, SparseMoE) or not len(block.experts):
            continue
        parts = [(m.gate_proj, m.up_proj, m.down_proj) for m in block.experts]
        if any(type(p) is not FloatLinear or p.bias is not None for ps in parts for p in ps):
            continue
        gate = parts[0][0].weight
        inter, hidden = gate.shape
        w13 = torch.empty(len(parts), 2 * inter, hidden, dtype=gate.dtype, device=device).normal_(
            0.0, std, generator=gen
        )
        w2 = torch.empty(len(parts), hidden, inter, dtype=gate.dtype, device=device).normal_(0.0, std, generator=gen)
        for e, (g, u, d) in enumerate(parts):
            g.weight = nn.Parameter(w13[e, :inter], requires_grad=False)
            u.weight = nn.Parameter(w13[e, inter:], requires_grad=False)
            d.weight = nn.Parameter(w2[e], requires_grad=False)
            made.update((g, u, d))
        made.update(block.experts.modules())
    return made
