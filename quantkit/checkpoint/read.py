"""Read a quantkit checkpoint's files: its quantization config, its tensors' headers and data, and the checks that
what is stored is what the config says (shapes, dtypes, finite scales, group indices)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import safe_open

from quantkit.checkpoint.config import module_schemes
from quantkit.errors import QuantkitError
from quantkit.models.loading import read_config
from quantkit.nn.factory import quantized_modules

SAFETENSORS_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int64: "I64",
                      torch.int32: "I32", torch.int8: "I8", torch.uint8: "U8",
                      torch.float8_e4m3fn: "F8_E4M3"}  # fmt: skip


def read_quantization_config(folder: Path) -> dict:
    """The checked ``quantization_config`` of ``folder/config.json``."""
    if not (folder / "config.json").is_file():
        raise QuantkitError(f"{folder} is not a checkpoint folder (no config.json)")
    qc = read_config(folder).get("quantization_config")
    if not isinstance(qc, dict):
        raise QuantkitError(f"{folder} is not quantized (config.json has no quantization_config)")
    module_schemes(qc)  # validates
    return qc


def tensor_headers(folder: Path) -> dict[str, tuple[list[int], str]]:
    """name -> (shape, safetensors dtype) for every tensor of the checkpoint (no tensor data is read)."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise QuantkitError(f"{folder} has no .safetensors files")
    out = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():  # noqa: SIM118 (safe_open is not a dict)
                    sl = st.get_slice(name)
                    out[name] = (list(sl.get_shape()), sl.get_dtype())
        except Exception as exc:
            raise QuantkitError(f"{f} is not a readable safetensors file: {exc}") from None
    return out


class StoredTensors(Mapping):
    """The tensors of a folder's safetensors files as a read-only mapping that reads each one when it is asked for
    (memory for one tensor at a time, not the checkpoint); the headers are read, and checked, at once."""

    def __init__(self, folder: Path) -> None:
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise QuantkitError(f"{folder} has no .safetensors files")
        self._where: dict[str, Path] = {}
        for f in files:
            try:
                with safe_open(str(f), framework="pt") as st:
                    self._where.update(dict.fromkeys(st.keys(), f))
            except Exception as exc:
                raise QuantkitError(f"cannot load {f}: not a readable safetensors file: {exc}") from None

    def __getitem__(self, name: str) -> torch.Tensor:
        with safe_open(str(self._where[name]), framework="pt") as st:
            return st.get_tensor(name)

    def __iter__(self):
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's safetensors files; a missing or unreadable file is a one-line error."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise QuantkitError(f"{folder} has no .safetensors files")
    tensors = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():  # noqa: SIM118 (safe_open is not a dict)
                    tensors[name] = st.get_tensor(name)
        except Exception as exc:
            raise QuantkitError(f"cannot load {f}: not a readable safetensors file: {exc}") from None
    return tensors


def check_quantized_tensors(where, model: torch.nn.Module, stored: dict[str, str]) -> None:
    """A checkpoint's integer and fp8 tensors must be stored in the dtype the layer reads (a cast would change the
    codes), its scales must be finite, every ``g_idx`` must name one of its layer's groups and every progressive W4A8
    layer's buffers must lie on its grid. ``stored``: name -> safetensors dtype."""
    buffers = dict(model.named_buffers())
    for name, buf in buffers.items():
        if name.endswith((".scales", ".weight_scale")) and not bool(torch.isfinite(buf).all()):
            raise QuantkitError(f"corrupt checkpoint {where}: {name} holds NaN or infinite scales")
        if buf.dtype.is_floating_point and buf.dtype != torch.float8_e4m3fn:
            continue
        want = SAFETENSORS_DTYPES[buf.dtype]
        if name in stored and stored[name] != want:
            raise QuantkitError(f"corrupt checkpoint {where}: {name} is stored as {stored[name]}, expected {want}")
        scales = buffers.get(name.removesuffix("g_idx") + "scales")
        if name.endswith(".g_idx") and buf.numel() and scales is not None:
            groups = scales.shape[0]
            if int(buf.min()) < 0 or int(buf.max()) >= groups:
                raise QuantkitError(f"corrupt checkpoint {where}: {name} names groups outside [0, {groups})")
    for name, module in quantized_modules(model).items():  # progressive W4A8: its buffers' integer grid
        problem = module.grid_problem() if module.scheme.progressive else None
        if problem:
            raise QuantkitError(f"corrupt checkpoint {where}: {name}.{problem}")


def check_stored_shapes(where, model: torch.nn.Module, files) -> None:
    """Every tensor of a quantized module in the safetensors ``files`` must have the shape that module's scheme in
    config.json gives it (``model``: the skeleton with quantized modules swapped in). Read from the files' headers,
    before any weight is loaded, so that a config edited or copied from another checkpoint is named as such
    instead of surfacing as transformers' size-mismatch report. Their integer and fp8 tensors must also be stored
    in the dtype the module declares: transformers keeps an integer tensor's stored dtype (no cast), so after
    loading the module's buffer no longer tells what it should have been."""
    shapes, dtypes = {}, {}
    for f in files:
        if not str(f).endswith(".safetensors"):
            continue
        try:
            with safe_open(str(f), framework="pt") as st:
                for key in st.keys():  # noqa: SIM118 (safe_open is not a dict)
                    part = st.get_slice(key)
                    shapes[key], dtypes[key] = tuple(part.get_shape()), part.get_dtype()
        except Exception as exc:
            raise QuantkitError(f"cannot load {f}: not a readable safetensors file: {exc}") from None
    check_shapes(where, model, shapes)
    for name, module in quantized_modules(model).items():
        for key, buf in module.named_buffers(recurse=False):
            if buf.dtype.is_floating_point and buf.dtype != torch.float8_e4m3fn:
                continue
            want, got = SAFETENSORS_DTYPES[buf.dtype], dtypes.get(f"{name}.{key}")
            if got is not None and got != want:
                raise QuantkitError(f"corrupt checkpoint {where}: {name}.{key} is stored as {got}, expected {want}")


def check_shapes(where, model: torch.nn.Module, shapes: dict[str, tuple[int, ...]]) -> None:
    """The same check on ``shapes`` (tensor name -> shape)."""
    for name, module in quantized_modules(model).items():
        for key, buf in module.named_buffers(recurse=False):
            shape = shapes.get(f"{name}.{key}")
            if shape is not None and tuple(shape) != tuple(buf.shape):
                raise QuantkitError(
                    f"corrupt checkpoint {where}: {name}.{key} is stored as {list(shape)}, but the scheme its "
                    f"config gives the module ({module.scheme.name}) expects {list(buf.shape)}"
                )
