"""Export a quantkit checkpoint into the formats other tools serve.

- ``compressed-tensors``: llm-compressor's format, read by vLLM and by transformers through the
  ``compressed-tensors`` package. Every quantkit scheme maps onto it: weight-only integer schemes of 2-8 bits
  (``pack-quantized``: groups that divide the input width or per-channel, symmetric or with zero points; not
  act-order's ``g_idx``, which compressed-tensors 0.20 removed: export those as GPTQ), W8A8 int8
  (``int-quantized``) and fp8 (``float-quantized``) with dynamic per-token or static per-tensor activations, and
  block-wise fp8 (``float-quantized``, weights by ``block``, activations by ``group`` of the block's width).
  vLLM's weight-only path takes 4 and 8 bits; 2- and 3-bit exports are for the compressed-tensors package.
- ``awq``: AutoAWQ's GEMM layout (4-bit groups with zero points, packed along the output in AWQ's interleaved
  order), read by vLLM, TGI and transformers + autoawq. One 4-bit scheme with groups, no act-order.
- ``gptq``: GPTQ checkpoint format v1 (zero points stored minus one), read by vLLM, TGI, GPTQModel and
  transformers + optimum. It holds one weight-only integer scheme for the whole model, 2/3/4/8 bits, groups that
  divide the input width; layers left in float are declared in ``dynamic`` as ``-:`` patterns.
- ``fp8``: DeepSeek-V3's own block-wise fp8 layout (``quant_method: fp8``, ``weight_block_size``), read by vLLM,
  SGLang and transformers' fine-grained FP8 loader: ``weight`` float8_e4m3fn [N, K] and ``weight_scale_inv`` fp32
  [ceil(N/B), ceil(K/B)] (the multiplier, despite its name). One block-wise scheme for the whole model.

All re-encode the same integers and store the scales as quantkit holds them (fp16 for weight-only layers, fp32
for W8A8): nothing is re-quantized or rounded, so the exported model computes what the quantkit checkpoint
computes, up to what a reader does with the scales (readers that allocate them in the model's dtype round fp16
scales to bf16 in a bf16 model). A checkpoint a format cannot hold exactly is refused with the reason (e.g. an
asymmetric group whose zero point is 0, which GPTQ v1 stores as 2^b - 1 and every v1 reader decodes as 2^b:
the v1 wrap; a group size that does not divide a layer's inputs, or exceeds them, where readers reserve K // G
groups), never written approximately. An exported folder carries ``quantkit_export`` in its config.json: what
``--overwrite`` may replace (never another tool's checkpoint).

Layouts as written: GPTQ ``qweight`` int32 [K b / 32, N] packed along the input, lowest bits first, ``qzeros``
int32 [n_g, N b / 32] along the output, ``scales`` fp16 [n_g, N], ``g_idx`` int32 [K]. compressed-tensors
``weight_packed`` int32 [N, ceil(K b / 32)] (codes offset by 2^(b-1), which for unsigned codes is the code
itself: the transpose of quantkit's ``qweight``), ``weight_scale`` [N, n_g], ``weight_zero_point`` int32
[ceil(N b / 32), n_g] (asymmetric only), ``weight_shape`` int64 [2].
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from quantkit.checkpoint.config import module_schemes
from quantkit.checkpoint.mtp import mtp_schemes
from quantkit.checkpoint.read import read_tensors
from quantkit.checkpoint.save import (
    EXPORT_FORMATS,
    EXPORT_MARK,
    SHARD_BYTES,
    atomic_folder,
    check_apart,
    check_output,
    versions,
    write_shards,
)
from quantkit.errors import QuantkitError, one_line
from quantkit.models.arch import arch_for
from quantkit.models.experts import split_all_fused_experts
from quantkit.quant.packing import pack_cols, unpack_cols, unpack_rows
from quantkit.quant.scheme import QuantScheme

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")


@dataclass
class Exported:
    """What ``export_checkpoint`` wrote."""

    path: Path
    fmt: str
    modules: int  # quantized linears


def export_checkpoint(src: str | os.PathLike, out: str | os.PathLike, fmt: str, overwrite: bool = False) -> Exported:
    """Write the quantkit checkpoint in ``src`` to ``out`` in format ``fmt`` (one of ``EXPORT_FORMATS``); the
    tokenizer and every other file of ``src`` are copied. Atomic like ``save_quantized``."""
    if fmt not in EXPORT_FORMATS:
        raise QuantkitError(f"unknown export format {fmt!r} (one of: {', '.join(EXPORT_FORMATS)})")
    folder, config, qc = read_quantized_folder(src)
    schemes = {**module_schemes(qc), **mtp_schemes(qc)}  # quantized MTP layers are exported like the others
    check_apart(check_output(out, overwrite), folder)  # refuse a bad output before the work
    tensors = read_tensors(folder)
    layers = {name: module_tensors(name, tensors) for name in schemes}
    _refuse_progressive(schemes, fmt)
    for name, layer in layers.items():
        need = {"qweight", "qzeros", "scales", "g_idx"} if schemes[name].packed else {"weight", "weight_scale"}
        if not need <= set(layer):
            raise QuantkitError(f"corrupt checkpoint {folder}: {name} lacks {', '.join(sorted(need - set(layer)))}")
    float_linears = sorted(set(linear_names(model_skeleton(config, qc))) - set(schemes))
    new_qc = CONVERTERS[fmt](tensors, layers, schemes, float_linears)
    config = {**config, EXPORT_MARK: {"format": fmt, "source": str(folder), "quantkit": versions()["quantkit"]}}
    path = write_converted(folder, out, overwrite, config, new_qc, tensors)
    return Exported(path, fmt, len(schemes))


def export_formats(src: str | os.PathLike) -> dict[str, str | None]:
    """Format -> None where the checkpoint in ``src`` can be exported to it, else why not: the checks
    :func:`export_checkpoint` makes, run in memory on the stored tensors; nothing is written."""
    folder, config, qc = read_quantized_folder(src)
    schemes = module_schemes(qc)
    tensors = read_tensors(folder)
    float_linears = sorted(set(linear_names(model_skeleton(config, qc))) - set(schemes))
    reasons: dict[str, str | None] = {}
    for fmt in EXPORT_FORMATS:
        trial = dict(tensors)  # the converters replace entries of the dict, never a tensor's contents
        try:
            CONVERTERS[fmt](trial, {name: module_tensors(name, trial) for name in schemes}, schemes, float_linears)
            reasons[fmt] = None
        except QuantkitError as exc:
            reasons[fmt] = str(exc)
    return reasons


LEGACY_CONFIGS = {"quantize_config.json": "gptq", "quant_config.json": "awq"}  # AutoGPTQ's, AutoAWQ's own files


def read_quantized_folder(src: str | os.PathLike, legacy: bool = False) -> tuple[Path, dict, dict]:
    """(folder, config, quantization_config) of a quantized checkpoint folder, or a QuantkitError. ``legacy``:
    without a quantization_config in config.json, read AutoGPTQ's ``quantize_config.json`` or AutoAWQ's
    ``quant_config.json`` (folders written before transformers carried the settings)."""
    from quantkit.models.loading import read_config

    if not isinstance(src, str | os.PathLike):
        raise QuantkitError(f"a checkpoint folder's path is needed, got {type(src).__name__}")
    folder = Path(src).expanduser()
    if not folder.is_dir():
        raise QuantkitError(f"checkpoint not found: {folder}")
    config = read_config(folder)
    qc = config.get("quantization_config")
    for name, method in LEGACY_CONFIGS.items():
        if qc is None and legacy and (folder / name).is_file():
            try:
                qc = {"quant_method": method, **json.loads((folder / name).read_text())}
            except (json.JSONDecodeError, TypeError, UnicodeDecodeError):
                raise QuantkitError(f"{folder / name} is not a JSON object") from None
    if not isinstance(qc, dict):
        raise QuantkitError(f"{folder} is not a quantized checkpoint (its config.json has no quantization_config)")
    return folder, config, qc


def write_converted(folder: Path, out, overwrite: bool, config: dict, qc: dict, tensors: dict) -> Path:
    """``folder`` re-encoded into ``out``: ``config`` with ``qc`` as its quantization_config, ``tensors`` as the
    weights, every other file copied."""
    out = check_output(out, overwrite)
    with atomic_folder(out) as tmp:
        for path in folder.iterdir():
            if path.is_file() and path.name not in ("config.json", *WEIGHT_FILES) and path.suffix != ".safetensors":
                shutil.copy2(path, tmp / path.name)
        (tmp / "config.json").write_text(json.dumps({**config, "quantization_config": qc}, indent=2, sort_keys=True)
                                         + "\n")  # fmt: skip
        write_shards(tensors, tmp, SHARD_BYTES)
    return out


def module_tensors(name: str, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The stored tensors of one quantized module, by their short names."""
    prefix = f"{name}."
    found = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix) and "." not in k[len(prefix) :]}
    if not found:
        raise QuantkitError(f"corrupt checkpoint: no tensors for quantized module {name}")
    return found


def model_skeleton(config: dict, qc: dict | None = None) -> torch.nn.Module:
    """The model the config describes, built on the meta device (no memory), without its quantization_config; with
    the checkpoint's ``qc``, its mixture-of-experts layers split into one linear per expert projection where the
    checkpoint holds them so (``split_experts``: how quantkit quantizes fused experts)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    plain = {k: v for k, v in config.items() if k != "quantization_config"}
    try:
        cfg = AutoConfig.for_model(**plain)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg)
    except Exception as exc:
        raise QuantkitError(f"cannot build the model of this checkpoint's config: {one_line(exc)}") from None
    if qc and qc.get("split_experts"):
        arch = arch_for(model)
        split_all_fused_experts(model, model.get_submodule(arch.layers), arch.fused_experts, materialize=False)
    return model


def linear_names(model: torch.nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]


def _trivial_g_idx(g_idx: torch.Tensor, scheme: QuantScheme) -> bool:
    k = g_idx.numel()
    return torch.equal(g_idx.long(), torch.arange(k) // scheme.group_of(k))


def _check_whole_groups(name: str, k: int, scheme: QuantScheme, fmt: str) -> None:
    if scheme.group_size != -1 and k % scheme.group_size:  # also K < group size: readers reserve K // G groups
        raise QuantkitError(f"{name}: group size {scheme.group_size} does not divide its {k} inputs; {fmt} (like "
                            f"every export format) has no shorter last group: quantize with a group size that divides "
                            f"{k}")  # fmt: skip


def _one_scheme(schemes: dict[str, QuantScheme], fmt: str) -> QuantScheme:
    distinct = sorted({s.name for s in schemes.values()})
    if len(distinct) != 1:
        raise QuantkitError(f"{fmt} holds one scheme for the whole model, this checkpoint has {', '.join(distinct)} "
                            "(export it as compressed-tensors)")  # fmt: skip
    return next(iter(schemes.values()))


def _refuse_activations(scheme: QuantScheme, fmt: str) -> None:
    """W4A8's 4-bit weights fit GPTQ's and AWQ's buffers, but those configs cannot say that activations are
    quantized: a reader would serve the checkpoint as W4A16, another model than the one quantized."""
    if scheme.w4a8:
        raise QuantkitError(f"{fmt} cannot declare the 8-bit per-token activations of {scheme.name} (a reader would "
                            "run it as W4A16): export it as compressed-tensors")  # fmt: skip


def _refuse_progressive(schemes: dict[str, QuantScheme], fmt: str) -> None:
    """Progressive W4A8's weights are 4-bit codes under integer group scales and zeros under a per-channel fp32
    scale: no export format can say a two-level integer grid (a one-level rewrite would re-quantize the scales)."""
    progressive = sorted({s.name for s in schemes.values() if s.progressive})
    if progressive:
        raise QuantkitError(f"{fmt} cannot hold {progressive[0]}'s two-level grid (integer group scales and zeros "
                            "under a per-channel scale, QServe's format): it stays a quantkit checkpoint")  # fmt: skip


def _dims(layer: dict[str, torch.Tensor], scheme: QuantScheme) -> tuple[int, int]:
    """(N, K) of a layer as stored."""
    if scheme.packed:
        return layer["scales"].shape[1], layer["g_idx"].numel()
    return tuple(layer["weight"].shape)


# -- compressed-tensors ------------------------------------------------------------------------------------------


def _ct_args(scheme: QuantScheme) -> dict:
    """The ``weights`` / ``input_activations`` arguments of one config group."""
    per_channel = scheme.group_size == -1
    b = scheme.block_size
    weights = {
        "num_bits": scheme.bits,
        "type": "float" if scheme.fmt == "fp8" else "int",
        "symmetric": scheme.sym,
        "strategy": "block" if b else "channel" if per_channel else "group",
        "group_size": None if per_channel else scheme.group_size,
        "block_structure": [b, b] if b else None,
        "dynamic": False,
        "actorder": None,
        "observer": "minmax",
    }
    inputs = None
    if not scheme.weight_only:
        inputs = {
            "num_bits": 8,
            "type": "float" if (scheme.act_fmt or scheme.fmt) == "fp8" else "int",
            "symmetric": True,
            "strategy": "group" if b else "token" if scheme.act_dynamic else "tensor",
            "group_size": b,
            "block_structure": None,
            "dynamic": scheme.act_dynamic,
            "actorder": None,
            "observer": None if scheme.act_dynamic else "minmax",
        }
    if scheme.packed:  # W4A8 too: its input_activations say how activations are quantized (llm-compressor's W4A8)
        fmt = "pack-quantized"
    else:
        fmt = "float-quantized" if scheme.fmt == "fp8" else "int-quantized"
    return {"weights": weights, "input_activations": inputs, "output_activations": None, "format": fmt}


def _to_compressed_tensors(tensors, layers, schemes, float_linears) -> dict:
    _refuse_progressive(schemes, "compressed-tensors")
    groups: dict[str, dict] = {}
    for name, scheme in schemes.items():
        layer = layers[name]
        n, k = _dims(layer, scheme)
        for short in layer:
            del tensors[f"{name}.{short}"]
        if scheme.packed:
            b = scheme.bits
            _check_whole_groups(name, k, scheme, "compressed-tensors")
            if not _trivial_g_idx(layer["g_idx"], scheme):
                raise QuantkitError(f"{name} has act-order groups (g_idx), which compressed-tensors no longer holds "
                                    "(0.20 removed them): export as gptq, or quantize with static_groups")  # fmt: skip
            tensors[f"{name}.weight_packed"] = layer["qweight"][: -(-k * b // 32)].t().contiguous()
            tensors[f"{name}.weight_scale"] = layer["scales"].t().contiguous()  # fp16, as quantkit holds them
            tensors[f"{name}.weight_shape"] = torch.tensor([n, k], dtype=torch.int64)
            if not scheme.sym:
                tensors[f"{name}.weight_zero_point"] = layer["qzeros"].t()[: -(-n * b // 32)].contiguous()
        else:
            tensors[f"{name}.weight"] = layer["weight"]
            scale = layer["weight_scale"]  # fp32, as quantkit holds them; block-wise: [ceil(N/B), ceil(K/B)] already
            tensors[f"{name}.weight_scale"] = scale if scheme.block_size else scale.reshape(n, 1)
            if "input_scale" in layer:
                tensors[f"{name}.input_scale"] = layer["input_scale"].reshape(1)
        if "bias" in layer:
            tensors[f"{name}.bias"] = layer["bias"]
        key = json.dumps(_ct_args(scheme), sort_keys=True)
        groups.setdefault(key, {"targets": []})["targets"].append(name)
    config_groups = {}
    for i, (key, group) in enumerate(groups.items()):
        args = json.loads(key)
        targets = ["Linear"] if len(groups) == 1 else sorted(group["targets"])
        config_groups[f"group_{i}"] = {"targets": targets, **args}
    formats = {g["format"] for g in config_groups.values()}
    qc = {
        "quant_method": "compressed-tensors",
        "format": formats.pop() if len(formats) == 1 else "mixed-precision",
        "quantization_status": "compressed",
        "config_groups": config_groups,
        "ignore": float_linears,
        "kv_cache_scheme": None,
        "sparsity_config": {},
        "global_compression_ratio": None,
    }
    return qc


# -- GPTQ v1 -----------------------------------------------------------------------------------------------------


def _to_gptq(tensors, layers, schemes, float_linears) -> dict:
    _refuse_progressive(schemes, "GPTQ")
    scheme = _one_scheme(schemes, "GPTQ")
    _refuse_activations(scheme, "GPTQ")
    if not scheme.weight_only or scheme.fmt != "int":
        raise QuantkitError(f"GPTQ holds weight-only integer schemes, not {scheme.name} (use compressed-tensors)")
    b = scheme.bits
    desc_act = False
    for name, layer in layers.items():
        n, k = _dims(layer, scheme)
        if (k * b) % 32 or (n * b) % 32:
            raise QuantkitError(f"{name} [{n} x {k}] does not fill whole {b}-bit GPTQ words along both dimensions "
                                "(use compressed-tensors)")  # fmt: skip
        _check_whole_groups(name, k, scheme, "GPTQ")
        zeros = unpack_cols(layer["qzeros"], b, n).to(torch.int64)  # [n_g, N]
        if not scheme.sym and bool((zeros == 0).any()):
            raise QuantkitError(f"{name} has zero points equal to 0, which GPTQ v1 cannot store (it writes zero - 1; "
                                "readers would decode 2^bits): use compressed-tensors")  # fmt: skip
        tensors[f"{name}.qweight"] = layer["qweight"][: k * b // 32].contiguous()
        tensors[f"{name}.qzeros"] = pack_cols((zeros - 1) & (2**b - 1), b)[:, : n * b // 32].contiguous()
        desc_act |= not _trivial_g_idx(layer["g_idx"], scheme)
    qc = {
        "quant_method": "gptq",
        "checkpoint_format": "gptq",
        "bits": b,
        "group_size": scheme.group_size,
        "sym": scheme.sym,
        "desc_act": desc_act,
        "static_groups": False,
        "true_sequential": True,
        "lm_head": False,
    }
    inner = [n for n in float_linears if n != "lm_head"]
    if inner:  # GPTQModel's and vLLM's way of declaring modules that stayed in float
        qc["dynamic"] = {f"-:^{re.escape(name)}$": {} for name in inner}
    return qc


# -- AWQ GEMM ----------------------------------------------------------------------------------------------------

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a packed word holds column 8c + AWQ_ORDER[i] (AutoAWQ's GEMM)


def awq_pack(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes [R, N] (N a multiple of 8) -> int32 [R, N / 8] in AWQ's interleaved order."""
    r, n = codes.shape
    c = codes.to(torch.int64).view(r, n // 8, 8)
    words = torch.zeros(r, n // 8, dtype=torch.int64)
    for i, col in enumerate(AWQ_ORDER):
        words |= c[:, :, col] << (4 * i)
    return (words - ((words >> 31) << 32)).to(torch.int32)  # the low 32 bits as a signed word


def awq_unpack(words: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`awq_pack`: int32 [R, N / 8] -> codes int64 [R, N]."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    codes = torch.empty(*w.shape, 8, dtype=torch.int64)
    for i, col in enumerate(AWQ_ORDER):
        codes[:, :, col] = (w >> (4 * i)) & 0xF
    return codes.view(w.shape[0], -1)


def _to_awq(tensors, layers, schemes, float_linears) -> dict:
    _refuse_progressive(schemes, "AWQ")
    scheme = _one_scheme(schemes, "AWQ")
    _refuse_activations(scheme, "AWQ")
    if not scheme.weight_only or scheme.fmt != "int" or scheme.bits != 4 or scheme.group_size == -1:
        raise QuantkitError(f"AWQ holds 4-bit weight-only groups, not {scheme.name} (use compressed-tensors)")
    for name, layer in layers.items():
        n, k = _dims(layer, scheme)
        _check_whole_groups(name, k, scheme, "AWQ")
        if n % 8:
            raise QuantkitError(f"{name}: AWQ packs outputs by 8, it has {n} (use compressed-tensors)")
        if not _trivial_g_idx(layer["g_idx"], scheme):
            raise QuantkitError(f"{name} has act-order groups (g_idx), which AWQ cannot hold: export as gptq")
        tensors[f"{name}.qweight"] = awq_pack(unpack_rows(layer["qweight"], 4, k))
        tensors[f"{name}.qzeros"] = awq_pack(unpack_cols(layer["qzeros"], 4, n))
        del tensors[f"{name}.g_idx"]
    inner = [n for n in float_linears if n != "lm_head"]
    return {
        "quant_method": "awq",
        "version": "gemm",
        "bits": 4,
        "group_size": scheme.group_size,
        "zero_point": True,
        "modules_to_not_convert": inner or None,
    }


# -- DeepSeek-V3's block-wise fp8 ----------------------------------------------------------------------------------


def _to_fp8_block(tensors, layers, schemes, float_linears) -> dict:
    _refuse_progressive(schemes, "fp8")
    scheme = _one_scheme(schemes, "fp8")
    _refuse_activations(scheme, "fp8 (DeepSeek-V3's layout)")
    if not scheme.block_size:
        raise QuantkitError(f"fp8 (DeepSeek-V3's layout) holds block-wise fp8 weights, not {scheme.name} "
                            "(use compressed-tensors)")  # fmt: skip
    for name, layer in layers.items():
        tensors[f"{name}.weight_scale_inv"] = layer["weight_scale"]
        del tensors[f"{name}.weight_scale"]
    b = scheme.block_size
    return {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [b, b],
        "modules_to_not_convert": float_linears or None,
    }


CONVERTERS = {"compressed-tensors": _to_compressed_tensors, "gptq": _to_gptq, "awq": _to_awq, "fp8": _to_fp8_block}
