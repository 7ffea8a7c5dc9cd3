"""Describe a quantkit checkpoint from its config and safetensors headers (no tensor data is read), and from its
``quant_report.json`` where it has one: the calibration tokens routed to each MoE expert."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch

from quantkit.checkpoint.config import layout_of, module_schemes
from quantkit.checkpoint.read import read_quantization_config, tensor_headers
from quantkit.errors import QuantkitError
from quantkit.quant.packing import Layout

DTYPE_BYTES = {"I32": 4, "F16": 2, "BF16": 2, "F32": 4, "I8": 1, "U8": 1, "F8_E4M3": 1, "I64": 8, "BOOL": 1}
NEEDED = {  # the tensors of a layout that give a layer's shape (others: weight, weight_scale)
    Layout.GPTQ_V2: ("qweight", "qzeros", "scales", "g_idx"),
    Layout.PROGRESSIVE_W4A8: ("qweight", "weight_scale", "group_scale", "group_zero", "perm"),
}


def _nbytes(shape: list[int], dtype: str) -> int:
    n = 1
    for d in shape:
        n *= d
    return n * DTYPE_BYTES.get(dtype, 4)


def inspect_checkpoint(folder: str | os.PathLike) -> dict:
    folder = Path(folder).expanduser()
    if not folder.is_dir():
        raise QuantkitError(f"checkpoint not found: {folder}")
    qc = read_quantization_config(folder)
    schemes = module_schemes(qc)
    headers = tensor_headers(folder)
    rows = []
    for name, scheme in schemes.items():
        own = {k.removeprefix(name + "."): v for k, v in headers.items() if k.startswith(name + ".")}
        if not own:
            raise QuantkitError(f"checkpoint {folder} lacks the tensors of {name}")
        needed = NEEDED.get(layout_of(scheme), ("weight", "weight_scale"))
        absent = [t for t in needed if t not in own]
        if absent:
            raise QuantkitError(f"corrupt checkpoint {folder}: {name}.{absent[0]} is missing")
        if scheme.packed:
            n, k = own["scales"][0][1], own["g_idx"][0][0]
        elif scheme.progressive:
            n, k = own["weight_scale"][0][0], own["perm"][0][0]
        else:
            n, k = own["weight"][0]
        nbytes = sum(_nbytes(*v) for v in own.values())
        rows.append(
            {
                "name": name,
                "scheme": scheme.name,
                "layout": layout_of(scheme).value,
                "shape": [n, k],
                "bytes": nbytes,
                "fp16_bytes": 2 * n * k,
                "ratio": 2 * n * k / nbytes,
            }
        )
    q_bytes = sum(r["bytes"] for r in rows)
    f_bytes = sum(r["fp16_bytes"] for r in rows)
    return {
        "folder": str(folder),
        "architecture": qc.get("architecture"),
        "format_version": qc.get("format_version"),
        "modules": rows,
        "totals": {
            "quantized_bytes": q_bytes,
            "fp16_bytes": f_bytes,
            "ratio": f_bytes / max(q_bytes, 1),
            "file_bytes": sum(_nbytes(*v) for v in headers.values()),
        },
        "recipe": qc.get("recipe", {}).get("name"),
        "stages": [s.get("method") for s in qc.get("recipe", {}).get("stages", [])],
        "calibration": qc.get("calibration"),
        "source_model": qc.get("source_model"),
        "versions": qc.get("versions"),
        "experts": expert_tokens(folder),
        "mtp": qc.get("mtp"),
    }


EXPERT_LINEAR = re.compile(r"^(.*)\.(\d+)\.[^.]+$")  # <layer>.mlp.experts.<e>.<projection>


def expert_tokens(folder: Path) -> list[dict]:
    """One row per MoE expert from the checkpoint's quant_report.json: {"experts": the experts module, "expert": e,
    "tokens": calibration tokens routed to it, "statistics": routed | all | none}; [] without a report or experts."""
    try:
        layers = json.loads((folder / "quant_report.json").read_text()).get("layers") or {}
    except (OSError, ValueError, AttributeError):
        return []
    rows = {}
    for name, values in layers.items():
        found = EXPERT_LINEAR.match(name)
        if isinstance(values, dict) and "expert_tokens" in values and found:
            rows[(found[1], int(found[2]))] = {"experts": found[1], "expert": int(found[2]),
                                               "tokens": values["expert_tokens"],
                                               "statistics": values.get("expert_statistics")}  # fmt: skip
    return [rows[key] for key in sorted(rows)]


GPUS = {"h100": ("H100", 132), "h200": ("H200", 132)}  # Hopper sm_90 cards: the dispatch rules see the same


def kernel_choices(info: dict, ms: list[int], device: str = "auto", dtype: torch.dtype = torch.float16) -> list[dict]:
    """Which kernel and config serve each distinct (scheme, shape) of ``inspect_checkpoint``'s modules at each M,
    on ``device``: "cuda" (this machine's GPU), "cpu", "h100" / "h200" (asked on any machine), or "auto" (cuda
    when there is one, else an H100's rules). One row per (scheme, shape, M), with the modules it covers."""
    from quantkit.kernels import GPU, explain

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "h100"
    if device in GPUS:
        name, sms = GPUS[device]
        target = GPU((9, 0), sms, name=name)
    elif device in ("cuda", "cpu"):
        if device == "cuda" and not torch.cuda.is_available():
            raise QuantkitError("--gpu cuda: no CUDA device here; ask about h100 or h200 instead")
        target = device
    else:
        raise QuantkitError(f"unknown device {device!r}; use auto, cuda, cpu, h100 or h200")
    by_name = module_schemes(read_quantization_config(Path(info["folder"])))
    groups: dict[tuple[str, int, int], list[str]] = {}
    schemes = {}
    for row in info["modules"]:
        key = (row["scheme"], *row["shape"])
        groups.setdefault(key, []).append(row["name"])
        schemes[key] = by_name[row["name"]]
    rows = []
    for (scheme, n, k), names in groups.items():
        for m in ms:
            line = explain(m, n, k, schemes[(scheme, n, k)], target, dtype)
            rows.append({"scheme": scheme, "shape": [n, k], "m": m, "modules": len(names), "kernel": line})
    return rows
