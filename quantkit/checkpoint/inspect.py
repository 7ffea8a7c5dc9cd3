"""Describe a quantkit checkpoint from its config and safetensors headers (no tensor data is read)."""

from __future__ import annotations

import os
from pathlib import Path

from quantkit.checkpoint.config import layout_of, module_schemes
from quantkit.checkpoint.read import read_quantization_config, tensor_headers
from quantkit.errors import QuantkitError

DTYPE_BYTES = {"I32": 4, "F16": 2, "BF16": 2, "F32": 4, "I8": 1, "U8": 1, "F8_E4M3": 1, "I64": 8, "BOOL": 1}


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
        needed = ("qweight", "qzeros", "scales", "g_idx") if scheme.weight_only else ("weight", "weight_scale")
        absent = [t for t in needed if t not in own]
        if absent:
            raise QuantkitError(f"corrupt checkpoint {folder}: {name}.{absent[0]} is missing")
        if scheme.weight_only:
            n, k = own["scales"][0][1], own["g_idx"][0][0]
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
    }
