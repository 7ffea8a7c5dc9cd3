"""Quantize a model larger than host memory: its decoder layers stay on disk until the runner reaches them.

``load_model(..., offload=True)`` asks transformers to dispatch the model with accelerate, every decoder layer
mapped to ``"disk"``: for a safetensors checkpoint accelerate then reads each tensor from the model's own files when
it is needed, and copies nothing. ``quantize`` takes such a model, or any model a user dispatched with accelerate
(layers offloaded to ``"disk"`` or ``"cpu"``): :func:`take_over` swaps accelerate's hooks for quantkit's own loads.
The modules outside the decoder layers (embeddings, final norm, head) are read at once; each decoder layer is read
when the runner reaches it (:func:`onload`) and stays in memory in its quantized form. Peak host memory is then the
modules outside the layers, one float layer, and the quantized layers done so far, instead of the whole float model.

accelerate's hooks cannot stay: they move a module's weights in for each forward and drop them afterwards, while
quantkit's stages replace the linears and rewrite weights between forwards.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

import torch
from torch import nn

from quantkit.errors import QuantkitError

_LOADER = "_quantkit_offloaded"  # module attribute: (weights map, names of the tensors it holds)
_SCRATCH = "_quantkit_offload_scratch"  # model attribute: the TemporaryDirectory of converted weights


def offload_device_map(config, layers_path: str) -> dict[str, str]:
    """A device map for ``from_pretrained``: every decoder layer (``layers_path``.i) on "disk", every other module on
    "cpu". Built from an empty (meta) model of ``config``, so it covers whatever modules the architecture has."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights():
        skeleton = AutoModelForCausalLM.from_config(config)
    device_map: dict[str, str] = {}

    def place(prefix: str, module: nn.Module) -> None:
        if prefix == layers_path:
            device_map.update({f"{prefix}.{i}": "disk" for i in range(len(module))})
            return
        if not layers_path.startswith(f"{prefix}." if prefix else ""):
            device_map[prefix] = "cpu"
            return
        if next(module.parameters(recurse=False), None) is not None:
            raise QuantkitError(f"cannot offload this model's layers: {prefix!r} holds tensors of its own")
        for name, child in module.named_children():
            place(f"{prefix}.{name}" if prefix else name, child)

    place("", skeleton)
    return device_map


def load_offloaded(folder: Path, config, dtype: torch.dtype, scratch_dir: Path | None = None):
    """The causal LM in ``folder`` (its ``config`` already read) with its decoder layers left on disk (see the module
    doc). Tensors that transformers converts while loading (fused experts) cannot be read in place: accelerate writes
    them to a scratch folder in ``scratch_dir`` (default: the system's temporary folder), deleted by :func:`finish`."""
    from transformers import AutoModelForCausalLM

    from quantkit.models.arch import arch_for

    if not any(folder.glob("*.safetensors")):
        raise QuantkitError(f"offloading layers reads them from safetensors files and {folder} has none")
    layers_path = arch_for((config.architectures or ["(none)"])[0]).layers
    try:
        scratch = tempfile.TemporaryDirectory(prefix=".quantkit-offload-", dir=scratch_dir)
    except OSError as exc:
        where = scratch_dir or tempfile.gettempdir()
        raise QuantkitError(f"cannot make a scratch folder in {where}: {exc.strerror or exc}") from None
    quiet = logging.getLogger("accelerate.big_modeling")  # "Some parameters are on the meta device": as asked
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            folder, dtype=dtype, device_map=offload_device_map(config, layers_path), offload_folder=scratch.name
        )
    except BaseException:
        scratch.cleanup()
        raise
    finally:
        quiet.setLevel(level)
    if any(Path(scratch.name).iterdir()):
        model.__dict__[_SCRATCH] = scratch  # read from until the last layer is in
    else:
        scratch.cleanup()
    return model


def finish(model: nn.Module) -> None:
    """Delete the scratch folder of :func:`load_offloaded`, if it wrote one (call once every layer is read)."""
    scratch = model.__dict__.pop(_SCRATCH, None)
    if scratch is not None:
        scratch.cleanup()


def _align_hooks(module: nn.Module):
    from accelerate.hooks import AlignDevicesHook, SequentialHook

    hook = getattr(module, "_hf_hook", None)
    hooks = hook.hooks if isinstance(hook, SequentialHook) else [hook]
    return [h for h in hooks if isinstance(h, AlignDevicesHook)]


def take_over(model: nn.Module, layers: nn.ModuleList) -> int:
    """Remove accelerate's hooks from a model with offloaded weights; what they offloaded comes back now outside
    ``layers`` and by :func:`onload` inside them. Returns how many decoder layers wait for :func:`onload`. A model
    that offloads nothing (no hooks, or hooks that only place modules on devices) is left as it is."""
    from accelerate.hooks import remove_hook_from_submodules

    offloaded = [(m, h) for m in model.modules() for h in _align_hooks(m) if h.offload and h.weights_map is not None]
    if not offloaded:
        return 0
    for module, hook in offloaded:
        names = [n for n, _ in module.named_parameters(recurse=hook.place_submodules)]
        if hook.offload_buffers:
            names += [n for n, _ in module.named_buffers(recurse=hook.place_submodules)]
        setattr(module, _LOADER, (hook.weights_map, names))
    remove_hook_from_submodules(model)
    for module in model.modules():
        own = module.__dict__.get("forward")
        if getattr(own, "__self__", None) is module and getattr(own, "__func__", None) is type(module).forward:
            del module.forward  # accelerate leaves the bound method behind: a cycle that keeps replaced layers alive
    if hasattr(model, "hf_device_map"):
        del model.hf_device_map  # no longer dispatched: quantkit moves the layers itself
    in_layers = {id(m) for m in layers.modules()}
    for module in model.modules():
        if id(module) not in in_layers:
            _load(module)
    return sum(any(hasattr(m, _LOADER) for m in layer.modules()) for layer in layers)


def _load(module: nn.Module) -> None:
    from accelerate.utils import set_module_tensor_to_device

    loader = module.__dict__.pop(_LOADER, None)
    if loader is None:
        return
    weights, names = loader
    for name in names:
        set_module_tensor_to_device(module, name, "cpu", value=weights[name])


def onload(layer: nn.Module) -> None:
    """Read the tensors of ``layer`` that :func:`take_over` left on disk into host memory (nothing to do for a
    layer that was never offloaded)."""
    for module in layer.modules():
        _load(module)
    missing = [n for n, p in layer.named_parameters() if p.is_meta]
    if missing:
        raise QuantkitError(f"a decoder layer's weights are on the meta device, with nothing to load them from: "
                            f"{', '.join(missing[:3])}")  # fmt: skip
