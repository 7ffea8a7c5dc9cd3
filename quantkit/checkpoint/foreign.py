"""Import checkpoints other tools wrote, GPTQ (v1 and v2), AWQ (GEMM), compressed-tensors and block-wise fp8
(DeepSeek-V3's own ``quant_method: fp8``), as quantkit ones.

The other direction of ``export.py``: the integers are copied into quantkit's layouts (nothing is re-quantized),
so an llm-compressor, GPTQModel, AutoGPTQ or AutoAWQ checkpoint can be evaluated, inspected, served by quantkit's
runtime and its kernels. What quantkit's layouts cannot hold exactly is refused with the reason:

- GPTQ: ``dynamic`` overrides that give some modules other bits or groups (``-:`` exclusions are fine), and v1
  zero points stored as 2^b - 1, which v1 readers decode as 2^b (the v1 wrap of an asymmetric zero of
  0; a b-bit zero point cannot hold it).
- AWQ: versions other than GEMM (GEMV, exllama and marlin re-layouts), no zero points.
- compressed-tensors: formats other than ``pack-quantized``, ``int-quantized``, ``float-quantized`` and
  ``naive-quantized``; a quantized KV cache, weight transforms, sparsity; asymmetric activations; weight-only
  strategies other than group / channel, W8A8 weight strategies other than channel / tensor / square blocks (a
  per-tensor scale is repeated per channel, exactly; blocks need activations by groups of the block's width).
- fp8 (DeepSeek-V3): static activations, non-square blocks or blocks that are not a power of two from 16 to 512
  (the block GEMM's K tile); an fp8 weight without its ``weight_scale_inv`` or with one of another shape than
  [ceil(N/B), ceil(K/B)]. Config groups are matched to modules as the library ranks them (an exact
  name, then a ``re:`` pattern matched at the start, then the class Linear), and each layer's packed width must
  fit its group's bits.
- Every weight-only format: scales that change when stored as fp16 (quantkit's weight-only scales) by more than
  fp16 rounding (bf16 or fp32 scales outside fp16's normal range); the largest change is reported.

Folders from before transformers carried the settings are read too: AutoGPTQ's ``quantize_config.json``, AutoAWQ's
``quant_config.json``. Malformed tensors or settings are one-line errors. Result: a quantkit checkpoint whose
``quantization_config`` has ``recipe`` ``imported-<method>`` and the source's quantization_config under
``imported_from``. Mixture-of-experts checkpoints that store one linear per expert (DeepSeek-V3's, llm-compressor's)
import with their experts split, as quantkit quantizes them. Multi-token-prediction layers past the last decoder
layer (DeepSeek-V3's ``model.layers.{num_hidden_layers}``, ``checkpoint/mtp.py``) are copied as they are, bit for
bit, and listed under ``mtp``.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from quantkit.checkpoint.config import FORMAT_VERSION, QUANT_METHOD, layout_of
from quantkit.checkpoint.export import (
    awq_unpack,
    linear_names,
    model_skeleton,
    module_tensors,
    read_quantized_folder,
    read_tensors,
    write_converted,
)
from quantkit.checkpoint.mtp import mtp_config, mtp_layers, split_mtp
from quantkit.checkpoint.read import check_shapes
from quantkit.checkpoint.save import check_apart, check_output, versions
from quantkit.checkpoint.swap import swap_in_quantized_modules
from quantkit.errors import QuantkitError, one_line
from quantkit.models.arch import arch_for
from quantkit.models.experts import PER_EXPERT, LinearExperts, split_all_fused_experts
from quantkit.quant.packing import LAYOUT_VERSIONS, pack_cols, pack_rows, packed_rows, unpack_cols, unpack_rows
from quantkit.quant.scheme import BLOCK_SIZES, QuantScheme

IMPORT_METHODS = ("gptq", "awq", "compressed-tensors", "fp8")
CT_FORMATS = ("pack-quantized", "int-quantized", "float-quantized", "naive-quantized")


@dataclass
class Imported:
    """What ``import_checkpoint`` wrote."""

    path: Path
    method: str  # the source's quant_method
    modules: int  # quantized linears
    scale_change: float = 0.0  # largest relative change of a scale stored as quantkit stores it


def import_checkpoint(src: str | os.PathLike, out: str | os.PathLike, overwrite: bool = False) -> Imported:
    """Write the GPTQ, AWQ, compressed-tensors or fp8 checkpoint in ``src`` to ``out`` as a quantkit checkpoint."""
    folder, config, qc = read_quantized_folder(src, legacy=True)
    method = qc.get("quant_method")
    if method == QUANT_METHOD:
        raise QuantkitError(f"{folder} is already a quantkit checkpoint")
    if method not in IMPORT_METHODS:
        raise QuantkitError(f"cannot import {method!r} checkpoints (quantkit imports {', '.join(IMPORT_METHODS)})")
    check_apart(check_output(out, overwrite), folder)  # refuse a bad output before the work
    skeleton, schemes, tensors, change = convert_foreign(folder, config, qc, read_tensors(folder))
    check_shapes(folder, skeleton, {key: tuple(t.shape) for key, t in tensors.items()})
    mtp = mtp_layers(config, tensors)
    arch = arch_for(skeleton)
    by_name = {s.name: s for s in schemes.values()}
    layouts = {name: layout_of(s) for name, s in by_name.items()}
    new_qc = {
        "quant_method": QUANT_METHOD,
        "format_version": FORMAT_VERSION,
        "schemes": {name: s.to_dict() for name, s in by_name.items()},
        "module_layouts": {name: lay.value for name, lay in layouts.items()},
        "layouts": {lay.value: LAYOUT_VERSIONS[lay] for lay in set(layouts.values())},
        "modules": {name: s.name for name, s in sorted(schemes.items())},
        "split_experts": any(isinstance(m, LinearExperts) for m in skeleton.modules()),
        "architecture": arch.name,
        "recipe": {"name": f"imported-{method}", "stages": []},
        "calibration": None,
        "source_model": str(folder),
        "imported_from": qc,
        "versions": versions(),
    }
    if mtp:
        heads = tuple(p + "." for p in mtp)
        new_qc["mtp"] = mtp_config(mtp, "keep", [k for k in tensors if k.startswith(heads)])
    path = write_converted(folder, out, overwrite, config, new_qc, tensors)
    return Imported(path, method, len(schemes), change[0])


def convert_foreign(folder: Path, config: dict, qc: dict, tensors: dict[str, torch.Tensor]):
    """(skeleton, schemes, tensors, scale change) of another tool's checkpoint: ``tensors`` (its stored tensors,
    rewritten in place) in quantkit's layouts, the scheme of each quantized linear, and the meta-device model a
    load builds for them; what cannot be read exactly is a QuantkitError. Shared by import and ``quantkit verify``."""
    method = qc.get("quant_method")
    if method not in IMPORT_METHODS:
        raise QuantkitError(f"cannot read {method!r} checkpoints (quantkit reads {', '.join(IMPORT_METHODS)})")
    skeleton = model_skeleton(config)
    arch = arch_for(skeleton)
    if arch.fused_experts and any(PER_EXPERT.search(k) for k in tensors):  # one linear per expert, as stored
        split_all_fused_experts(skeleton, skeleton.get_submodule(arch.layers), arch.fused_experts, materialize=False)
    _, mtp = split_mtp(config, tensors)  # copied as they are
    linears = set(linear_names(skeleton))
    change = [0.0]
    convert = {"gptq": _from_gptq, "awq": _from_awq, "compressed-tensors": _from_compressed_tensors,
               "fp8": _from_fp8_block}[method]  # fmt: skip
    try:
        schemes = convert(tensors, qc, linears, change)
    except (KeyError, IndexError, ValueError, RuntimeError, TypeError, AttributeError) as exc:  # malformed input
        raise QuantkitError(f"malformed {method} checkpoint {folder}: {type(exc).__name__}: {one_line(exc)}") from None
    tensors.update(mtp)
    if not schemes:
        raise QuantkitError(f"{folder}: no quantized linear found in its tensors")
    swap_in_quantized_modules(skeleton, schemes, split_experts=False)  # what a load will build: shapes must agree
    # (experts stored one linear each were split above, as a load splits them)
    return skeleton, schemes, tensors, change


def _check_linear(name: str, linears: set[str]) -> None:
    if name not in linears:
        raise QuantkitError(f"quantized tensors for {name}, which is not a linear layer of this model")


def _gptq_weight(tensors, name: str, scheme: QuantScheme, zeros_plus_one: bool, change) -> QuantScheme:
    """Rewrite one GPTQ module's tensors into quantkit's ``gptq_v2`` buffers, in place; returns its scheme."""
    b = scheme.bits
    layer = module_tensors(name, tensors)
    if not {"qweight", "qzeros", "scales"} <= set(layer):
        raise QuantkitError(f"{name}: a GPTQ module needs qweight, qzeros and scales, found {', '.join(sorted(layer))}")
    _check_dtypes(name, layer, {"qweight": torch.int32, "qzeros": torch.int32, "g_idx": torch.int32})
    scales = layer["scales"]
    n_g, n = scales.shape
    rows = layer["qweight"].shape[0]
    if not -(-n * b // 32) <= layer["qzeros"].shape[1] <= packed_rows(n, b) or layer["qzeros"].shape[0] != n_g:
        raise QuantkitError(f"{name}: qzeros {list(layer['qzeros'].shape)} does not hold {n_g} x {n} {b}-bit zeros")
    k = layer["g_idx"].numel() if "g_idx" in layer else rows * 32 // b
    if layer["qweight"].shape[1] != n or not -(-k * b // 32) <= rows <= packed_rows(k, b):
        raise QuantkitError(f"{name}: qweight {list(layer['qweight'].shape)} does not hold {k} x {n} {b}-bit codes")
    zeros = unpack_cols(_pad_words(layer["qzeros"], b, n, dim=1), b, n).to(torch.int64)
    if zeros_plus_one:
        if bool((zeros == 2**b - 1).any()):
            raise QuantkitError(f"{name}: a v1 zero point stored as {2**b - 1} means {2**b}, which {b} bits cannot "
                                "hold (the v1 wrap of a zero of 0: v1 readers compute wrong values there)")  # fmt: skip
        zeros = zeros + 1
    if scheme.sym and not bool((zeros == 2 ** (b - 1)).all()):
        scheme = QuantScheme(bits=b, group_size=scheme.group_size, sym=False)
    g_idx = layer.get("g_idx")
    if g_idx is None:
        g_idx = torch.arange(k) // scheme.group_of(k)
    if int(g_idx.min()) < 0 or int(g_idx.max()) >= n_g:
        raise QuantkitError(f"{name}: g_idx names groups outside [0, {n_g})")
    tensors[f"{name}.qweight"] = _pad_words(layer["qweight"], b, k, dim=0)
    tensors[f"{name}.qzeros"] = pack_cols(zeros, b)
    tensors[f"{name}.scales"] = _fp16_scales(name, scales, change)
    tensors[f"{name}.g_idx"] = g_idx.to(torch.int32).contiguous()
    return scheme


def _pad_words(words: torch.Tensor, bits: int, count: int, dim: int) -> torch.Tensor:
    """Packed words along ``dim`` padded with zero words to quantkit's whole runs of 32 codes."""
    want = packed_rows(count, bits)
    have = words.shape[dim]
    if have > want:
        raise QuantkitError(f"{have} packed words along dim {dim} for {count} codes of {bits} bits")
    pad = [0, 0, 0, 0]
    pad[3 - 2 * dim] = want - have  # F.pad's order: last dim first
    return torch.nn.functional.pad(words, pad).contiguous()


def _from_gptq(tensors, qc: dict, linears: set[str], change: list[float]) -> dict[str, QuantScheme]:
    bits, group_size = qc.get("bits"), qc.get("group_size", -1)
    if bits not in (2, 3, 4, 8) or not isinstance(group_size, int) or group_size == 0 or group_size < -1:
        raise QuantkitError(f"GPTQ config with bits {bits!r} and group_size {group_size!r} is not importable")
    dynamic = qc.get("dynamic") or {}
    if not isinstance(dynamic, dict):
        raise QuantkitError(f"GPTQ dynamic must be a mapping of patterns, got {type(dynamic).__name__}")
    for pattern, override in dynamic.items():
        if not pattern.startswith("-:") and override:
            raise QuantkitError(f"GPTQ dynamic override {pattern!r} gives modules other settings: not importable")
    fmt = qc.get("checkpoint_format", qc.get("format", "gptq"))
    if fmt not in ("gptq", "gptq_v2"):
        raise QuantkitError(f"GPTQ checkpoint_format {fmt!r} is not importable (gptq, gptq_v2)")
    scheme = QuantScheme(bits=bits, group_size=group_size, sym=bool(qc.get("sym", True)))
    schemes = {}
    for key in sorted(k for k in tensors if k.endswith(".qweight")):
        name = key.removesuffix(".qweight")
        _check_linear(name, linears)
        schemes[name] = _gptq_weight(tensors, name, scheme, fmt == "gptq", change)
    return schemes


def _from_awq(tensors, qc: dict, linears: set[str], change: list[float]) -> dict[str, QuantScheme]:
    bits, group_size, version = (
        qc.get("bits", qc.get("w_bit")),
        qc.get("group_size", qc.get("q_group_size")),
        (qc.get("version", "gemm")),
    )
    if bits != 4 or not isinstance(group_size, int) or group_size <= 0 or str(version).lower() != "gemm":
        raise QuantkitError(f"AWQ {bits}-bit group {group_size} version {version!r} is not importable "
                            "(4-bit GEMM checkpoints are)")  # fmt: skip
    if not qc.get("zero_point", True):
        raise QuantkitError("AWQ checkpoints without zero points are not importable")
    schemes = {}
    for key in sorted(k for k in tensors if k.endswith(".qweight")):
        name = key.removesuffix(".qweight")
        _check_linear(name, linears)
        layer = module_tensors(name, tensors)
        scales = layer.get("scales")
        if scales is None or "qzeros" not in layer:
            raise QuantkitError(f"{name}: an AWQ module needs qweight, qzeros and scales")
        _check_dtypes(name, layer, {"qweight": torch.int32, "qzeros": torch.int32})
        n_g, n = scales.shape
        q = awq_unpack(layer["qweight"])  # [K, N]
        k = q.shape[0]
        zeros = awq_unpack(layer["qzeros"])  # [n_g, N]
        if q.shape[1] != n or zeros.shape != (n_g, n) or n_g != -(-k // group_size):
            shapes = [list(t.shape) for t in (layer["qweight"], layer["qzeros"], scales)]
            raise QuantkitError(f"{name}: qweight, qzeros and scales of shapes {shapes} do not describe one "
                                f"{group_size}-group layer")  # fmt: skip
        sym = bool((zeros == 8).all())
        tensors[f"{name}.qweight"] = pack_rows(q, 4)
        tensors[f"{name}.qzeros"] = pack_cols(zeros, 4)
        tensors[f"{name}.scales"] = _fp16_scales(name, scales, change)
        tensors[f"{name}.g_idx"] = (torch.arange(k) // group_size).to(torch.int32)
        schemes[name] = QuantScheme(bits=4, group_size=group_size, sym=sym)
    return schemes


def _ct_group_of(name: str, groups: dict) -> dict:
    """The config group that targets module ``name``, as compressed-tensors ranks them: an exact name first, then a
    ``re:`` pattern matched at the start of the name (``re.match``), then the class name Linear."""
    ranked = []
    for group in groups.values():
        for target in group.get("targets") or []:
            if target == name:
                ranked.append((0, group))
            elif target.startswith("re:") and re.match(target[3:], name):
                ranked.append((1, group))
            elif target == "Linear":
                ranked.append((2, group))
    if not ranked:
        raise QuantkitError(f"{name} has quantized tensors but no config group targets it")
    return min(ranked, key=lambda r: r[0])[1]


def _from_compressed_tensors(tensors, qc: dict, linears: set[str], change: list[float]) -> dict[str, QuantScheme]:
    groups = qc.get("config_groups") or {}
    if not isinstance(groups, dict) or not all(isinstance(g, dict) for g in groups.values()):
        raise QuantkitError("compressed-tensors config_groups must map group names to groups")
    if qc.get("quantization_status", "compressed") != "compressed":
        raise QuantkitError(f"compressed-tensors status {qc.get('quantization_status')!r} is not importable")
    for key, what in (("kv_cache_scheme", "a quantized KV cache"), ("transform_config", "weight transforms"),
                      ("sparsity_config", "sparsity")):  # fmt: skip
        if qc.get(key):
            raise QuantkitError(f"compressed-tensors checkpoints with {what} ({key}) are not importable")
    schemes = {}
    names = sorted({k.rsplit(".", 1)[0] for k in tensors if k.endswith((".weight_packed", ".weight_scale"))})
    for name in names:
        _check_linear(name, linears)
        group = _ct_group_of(name, groups)
        fmt = group.get("format") or qc.get("format")
        if fmt not in CT_FORMATS:
            raise QuantkitError(f"compressed-tensors format {fmt!r} is not importable ({', '.join(CT_FORMATS)})")
        weights, inputs = group.get("weights") or {}, group.get("input_activations")
        if inputs is None:
            schemes[name] = _ct_weight_only(tensors, name, weights, change)
        elif weights.get("num_bits") == 4 and weights.get("type", "int") == "int":
            schemes[name] = _ct_w4a8(tensors, name, weights, inputs, change)
        else:
            schemes[name] = _ct_w8a8(tensors, name, weights, inputs)
    return schemes


def _ct_weight_only(tensors, name: str, weights: dict, change) -> QuantScheme:
    b, strategy = weights.get("num_bits"), weights.get("strategy")
    if weights.get("type", "int") != "int" or b not in (2, 3, 4, 8) or strategy not in ("group", "channel"):
        raise QuantkitError(f"{name}: weight-only {weights.get('type')} {b}-bit {strategy} is not importable")
    layer = module_tensors(name, tensors)
    _check_dtypes(name, layer, {"weight_packed": torch.int32})
    if "weight_packed" in layer:
        if "weight_shape" not in layer:
            raise QuantkitError(f"{name}: weight_packed without weight_shape")
        n, k = (int(v) for v in layer["weight_shape"])
        if list(layer["weight_packed"].shape) != [n, -(-k * b // 32)]:
            raise QuantkitError(f"{name}: weight_packed {list(layer['weight_packed'].shape)} does not hold {n} x {k} "
                                f"{b}-bit codes (the config group says {b} bits)")  # fmt: skip
        qweight = _pad_words(layer["weight_packed"].t(), b, k, dim=0)
    elif layer.get("weight", torch.empty(0)).dtype == torch.int8:  # naive-quantized: signed codes, one per byte
        n, k = layer["weight"].shape
        qweight = pack_rows((layer["weight"].to(torch.int64) + 2 ** (b - 1)).t(), b)
    else:
        raise QuantkitError(f"{name}: an int{b} weight-only layer needs weight_packed or an int8 weight")
    scheme = QuantScheme(bits=b, group_size=weights.get("group_size") if strategy == "group" else -1,
                         sym=bool(weights.get("symmetric", True)))  # fmt: skip
    scales = layer["weight_scale"].reshape(n, -1)
    if scales.shape[1] != scheme.n_groups(k):
        raise QuantkitError(f"{name}: weight_scale {list(layer['weight_scale'].shape)} does not hold "
                            f"{scheme.n_groups(k)} groups of {n} outputs")  # fmt: skip
    zp = layer.get("weight_zero_point")
    if zp is None:
        zeros = torch.full_like(scales, 2 ** (b - 1), dtype=torch.int64)
    elif zp.dtype == torch.int32:  # packed along the outputs, stored offset by 2^(b-1)
        zeros = unpack_rows(_pad_words(zp, b, n, dim=0), b, n).to(torch.int64)  # [N, n_g]
    else:  # one signed zero point per element
        zeros = zp.reshape(n, -1).to(torch.int64) + 2 ** (b - 1)
    if zeros.numel() and (int(zeros.min()) < 0 or int(zeros.max()) >= 2**b):
        raise QuantkitError(f"{name}: weight_zero_point outside the {b}-bit range")
    if scheme.sym and not bool((zeros == 2 ** (b - 1)).all()):
        scheme = QuantScheme(bits=b, group_size=scheme.group_size, sym=False)
    g_idx = layer.get("weight_g_idx")
    if g_idx is None:
        g_idx = torch.arange(k) // scheme.group_of(k)
    for short in layer:
        del tensors[f"{name}.{short}"]
    tensors[f"{name}.qweight"] = qweight
    tensors[f"{name}.qzeros"] = pack_cols(zeros.t(), b)
    tensors[f"{name}.scales"] = _fp16_scales(name, scales.t(), change)
    tensors[f"{name}.g_idx"] = g_idx.to(torch.int32).contiguous()
    if "bias" in layer:
        tensors[f"{name}.bias"] = layer["bias"]
    return scheme


def _ct_w4a8(tensors, name: str, weights: dict, inputs: dict, change) -> QuantScheme:
    """4-bit integer weights (stored as weight-only ones are) with 8-bit activations quantized per token."""
    kind, dynamic = inputs.get("type", "int"), bool(inputs.get("dynamic"))
    if inputs.get("num_bits") != 8 or kind not in ("int", "float") or not dynamic or inputs.get("strategy") != "token":
        raise QuantkitError(f"{name}: 4-bit weights import with 8-bit activations quantized per token at run time "
                            f"(W4A8), not {inputs.get('num_bits')}-bit {kind} by {inputs.get('strategy')}"
                            f"{'' if dynamic else ', static'}")  # fmt: skip
    if not inputs.get("symmetric", True):
        raise QuantkitError(f"{name}: asymmetric 8-bit activations are not importable")
    scheme = _ct_weight_only(tensors, name, weights, change)
    return scheme.replace(act_bits=8, act_fmt="fp8" if kind == "float" else "int")


def cast_scale(scale: torch.Tensor, dtype: torch.dtype, change: list[float]) -> torch.Tensor:
    """``scale`` in ``dtype``; ``change[0]`` keeps the largest relative change seen."""
    cast = scale.to(dtype)
    ref = scale.float()
    rel = ((cast.float() - ref).abs() / ref.abs().clamp_min(torch.finfo(torch.float32).tiny)).max()
    change[0] = max(change[0], float(rel))
    return cast.contiguous()


def _check_dtypes(name: str, layer: dict[str, torch.Tensor], dtypes: dict[str, torch.dtype]) -> None:
    for short, dtype in dtypes.items():
        if short in layer and layer[short].dtype != dtype:
            raise QuantkitError(f"{name}: {short} is stored as {layer[short].dtype}, expected {dtype}")


def _fp16_scales(name: str, scales: torch.Tensor, change) -> torch.Tensor:
    cast = cast_scale(scales, torch.float16, change)
    if change[0] > 2**-10:  # more than fp16's own rounding: values outside its normal range
        raise QuantkitError(f"{name}: its scales change by {change[0]:.1e} as fp16 (quantkit stores fp16 scales)")
    return cast


def _ct_w8a8(tensors, name: str, weights: dict, inputs: dict) -> QuantScheme:
    kind = weights.get("type", "int")
    if weights.get("num_bits") != 8 or inputs.get("num_bits") != 8 or kind != inputs.get("type", "int"):
        raise QuantkitError(f"{name}: only 8-bit weights with 8-bit activations of the same type import as W8A8")
    if not weights.get("symmetric", True) or not inputs.get("symmetric", True):
        raise QuantkitError(f"{name}: asymmetric 8-bit weights or activations are not importable")
    dynamic = bool(inputs.get("dynamic"))
    if weights.get("strategy") == "block":
        block = _block_size(name, weights.get("block_structure"))
        if kind != "float" or not dynamic or inputs.get("strategy") != "group" or inputs.get("group_size") != block:
            raise QuantkitError(f"{name}: fp8 weight blocks need dynamic fp8 activations by groups of {block} "
                                f"(got {kind}, {inputs.get('strategy')} of {inputs.get('group_size')})")  # fmt: skip
        layer = module_tensors(name, tensors)
        for short in layer:
            del tensors[f"{name}.{short}"]
        return _fp8_block_layer(tensors, name, layer.get("weight"), layer.get("weight_scale"), block, "weight_scale",
                                layer.get("bias"))  # fmt: skip
    if weights.get("strategy") not in ("channel", "tensor") or inputs.get("strategy") != (
        "token" if dynamic else "tensor"
    ):
        raise QuantkitError(f"{name}: weights by {weights.get('strategy')}, activations by {inputs.get('strategy')} "
                            "(dynamic per token or static per tensor) are not importable")  # fmt: skip
    layer = module_tensors(name, tensors)
    weight = layer["weight"]
    n = weight.shape[0]
    want = torch.int8 if kind == "int" else torch.float8_e4m3fn
    if weight.dtype != want:
        raise QuantkitError(f"{name}: weight stored as {weight.dtype}, expected {want}")
    scheme = QuantScheme(bits=8, group_size=-1, sym=True, act_bits=8, act_dynamic=dynamic,
                         fmt="int" if kind == "int" else "fp8")  # fmt: skip
    for short in layer:
        del tensors[f"{name}.{short}"]
    tensors[f"{name}.weight"] = weight
    tensors[f"{name}.weight_scale"] = layer["weight_scale"].float().reshape(-1).expand(n).contiguous()
    if not dynamic:
        if "input_scale" not in layer:
            raise QuantkitError(f"{name}: static activations without an input_scale")
        tensors[f"{name}.input_scale"] = layer["input_scale"].float().reshape(1)
    if "bias" in layer:
        tensors[f"{name}.bias"] = layer["bias"]
    return scheme


def _block_size(where: str, structure) -> int:
    """B of a square ``[B, B]`` weight block, or a one-line error."""
    ok = isinstance(structure, list | tuple) and len(structure) == 2 and structure[0] == structure[1]
    if not ok or structure[0] not in BLOCK_SIZES or isinstance(structure[0], bool):
        raise QuantkitError(f"{where}: weight block {structure!r} is not importable (square blocks of a power of two "
                            f"from {BLOCK_SIZES[0]} to {BLOCK_SIZES[-1]}: the block GEMM's K tile)")  # fmt: skip
    return structure[0]


def _fp8_block_layer(tensors, name: str, weight, scale, block: int, scale_name: str, bias=None) -> QuantScheme:
    """Store one block-wise fp8 layer in quantkit's ``fp8_block`` layout (the same bytes); returns its scheme."""
    if weight is None or weight.dtype != torch.float8_e4m3fn or weight.dim() != 2:
        got = "nothing" if weight is None else f"{weight.dtype} {list(weight.shape)}"
        raise QuantkitError(f"{name}: a block-wise fp8 layer needs a 2-D float8_e4m3fn weight, found {got}")
    n, k = weight.shape
    want = [-(-n // block), -(-k // block)]
    if scale is None:
        raise QuantkitError(f"{name}: fp8 weight without its {scale_name} (fp32 {want})")
    if list(scale.shape) != want:
        raise QuantkitError(f"{name}: {scale_name} {list(scale.shape)} does not fit a [{n}, {k}] weight in "
                            f"{block} x {block} blocks (expected {want})")  # fmt: skip
    if scale.dtype != torch.float32:
        raise QuantkitError(f"{name}: {scale_name} is stored as {scale.dtype}, expected torch.float32")
    tensors[f"{name}.weight"] = weight
    tensors[f"{name}.weight_scale"] = scale.contiguous()
    if bias is not None:
        tensors[f"{name}.bias"] = bias
    return QuantScheme(bits=8, group_size=-1, sym=True, fmt="fp8", act_bits=8, block_size=block)


def _from_fp8_block(tensors, qc: dict, linears: set[str], change: list[float]) -> dict[str, QuantScheme]:
    """DeepSeek-V3's layout: ``X.weight`` float8_e4m3fn [N, K] and ``X.weight_scale_inv`` fp32 [ceil(N/B),
    ceil(K/B)] for every quantized linear X, config ``weight_block_size: [B, B]``, dynamic activations."""
    block = _block_size("fp8 config", qc.get("weight_block_size"))
    if qc.get("activation_scheme", "dynamic") != "dynamic" or qc.get("fmt", "e4m3") != "e4m3":
        raise QuantkitError(f"fp8 checkpoints with {qc.get('activation_scheme')} {qc.get('fmt', 'e4m3')} "
                            "activations are not importable (dynamic e4m3 are)")  # fmt: skip
    scale_names = {k.removesuffix(".weight_scale_inv") for k in tensors if k.endswith(".weight_scale_inv")}
    fp8_names = {k.removesuffix(".weight") for k, t in tensors.items()
                 if k.endswith(".weight") and t.dtype == torch.float8_e4m3fn}  # fmt: skip
    orphans = sorted(scale_names - fp8_names)
    if orphans:
        raise QuantkitError(f"{orphans[0]}: a weight_scale_inv without an fp8 weight")
    schemes = {}
    for name in sorted(fp8_names):
        _check_linear(name, linears)
        scale = tensors.pop(f"{name}.weight_scale_inv", None)
        schemes[name] = _fp8_block_layer(tensors, name, tensors[f"{name}.weight"], scale, block, "weight_scale_inv")
    return schemes
