"""``quantkit verify``: check that a checkpoint holds what its config says, before anyone serves it.

A checkpoint can load without an error and still compute garbage: a loader that skips a tensor it does not expect
(an MoE expert dropped by a converter) leaves that module at its initial values. Verification builds, on the meta
device, the model the checkpoint's loader builds (quantkit's own loader for quantkit checkpoints; the importer's
conversion, :func:`quantkit.checkpoint.foreign.convert_foreign`, for GPTQ, AWQ, compressed-tensors and DeepSeek-style
fp8 folders) and compares it with what is stored:

- ``files``: every safetensors file is readable.
- ``loader``: the quantization config parses, names linears the model has, agrees with the architecture and names
  each scheme by what it says, and (other tools' folders) the conversion accepts every module's tensors (a GPTQ v1
  zero point that wraps, ...).
- ``coverage``: every stored tensor is consumed by the loader and every tensor the loader fills is stored (the
  names are listed); a tied head may be absent.
- ``shapes`` and ``dtypes``: each stored tensor has the shape the config gives it (the scheme's for quantized
  modules) and the dtype the quantized module reads (packed codes int32, weight-only scales fp16, ...).
- ``finite``: no NaN or infinity in any floating tensor.
- ``scales``: quantization scales are positive.
- ``zero_points``: a symmetric scheme's zero points are the grid's midpoint, and unused bits of packed words are 0.
- ``g_idx``: each entry names a group of its layer, and each group holds as many inputs as the scheme gives it.
  Progressive W4A8 instead: its group scales lie in [1, 15] (``scales``), its zero points in [0, 15]
  (``zero_points``), every code decodes to an int8 value, and ``perm`` is a permutation of its inputs (``g_idx``).

With a float ``baseline``, the checkpoint is loaded and compared on a few evaluation windows: mean KL divergence and
top-1 agreement (:mod:`quantkit.eval.perplexity`) against thresholds. A folder that cannot be verified at all (not
found, not a quantized checkpoint, a format quantkit does not read) is a QuantkitError; everything else is a check
that passes or fails.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from quantkit.checkpoint.config import QUANT_METHOD, module_schemes
from quantkit.checkpoint.export import model_skeleton, read_quantized_folder
from quantkit.checkpoint.foreign import IMPORT_METHODS, convert_foreign
from quantkit.checkpoint.mtp import mtp_layers
from quantkit.checkpoint.read import StoredTensors, read_tensors
from quantkit.checkpoint.swap import swap_in_quantized_modules
from quantkit.errors import QuantkitError
from quantkit.nn.factory import quantized_modules
from quantkit.quant.packing import unpack_cols

CHECKS = ("files", "loader", "coverage", "shapes", "dtypes", "finite", "scales", "zero_points", "g_idx")
SHOWN = 5  # names listed per failing check
DEFAULT_MAX_KL = 0.5  # nats per token: a working 4-bit model is far below, a broken one far above
DEFAULT_MIN_TOP1 = 0.6


@dataclass
class Verdict:
    """What :func:`verify_checkpoint` found: per check, the problems (none when it passed)."""

    folder: str
    method: str
    problems: dict[str, list[str]] = field(default_factory=dict)
    figures: dict | None = None  # with a baseline: kl, top1_agreement, perplexities, thresholds

    @property
    def ok(self) -> bool:
        return not any(self.problems.values())

    def line(self) -> str:
        """The one-line verdict."""
        if self.ok:
            extra = ""
            if self.figures:
                extra = f"; KL {self.figures['kl']:.4f}, top-1 {self.figures['top1_agreement']:.3f} vs baseline"
            return f"ok: {self.folder} ({self.method}) passes {len(self.problems)} checks{extra}"
        failed = [f"{name}: {'; '.join(_listed(found))}" for name, found in self.problems.items() if found]
        return f"FAILED: {self.folder} ({self.method}): " + " | ".join(failed)

    def to_dict(self) -> dict:
        return {"folder": self.folder, "method": self.method, "ok": self.ok, "problems": self.problems,
                "figures": self.figures}  # fmt: skip


def _listed(found: list[str]) -> list[str]:
    return found[:SHOWN] + ([f"... {len(found) - SHOWN} more"] if len(found) > SHOWN else [])


def verify_checkpoint(
    src: str | os.PathLike,
    baseline: str | None = None,
    *,
    data: str = "moby-dick",
    windows: int = 4,
    seqlen: int = 256,
    max_kl: float = DEFAULT_MAX_KL,
    min_top1: float = DEFAULT_MIN_TOP1,
    device: str = "cpu",
) -> Verdict:
    """Verify the quantkit, GPTQ, AWQ or compressed-tensors checkpoint folder ``src`` (see the module doc)."""
    folder, config, qc = read_quantized_folder(src, legacy=True)
    method = qc.get("quant_method")
    if method != QUANT_METHOD and method not in IMPORT_METHODS:
        readable = ", ".join((QUANT_METHOD, *IMPORT_METHODS))
        raise QuantkitError(f"cannot verify {method!r} checkpoints (quantkit reads {readable})")
    verdict = Verdict(str(folder), str(method), {name: [] for name in CHECKS})
    problems = verdict.problems
    try:  # quantkit's own folders are read a tensor at a time; other tools' are converted in memory, as on import
        tensors = StoredTensors(folder) if method == QUANT_METHOD else read_tensors(folder)
    except QuantkitError as exc:
        problems["files"].append(str(exc))
        return verdict
    try:
        if method == QUANT_METHOD:
            skeleton = model_skeleton(config)
            schemes = module_schemes(qc)
            swap_in_quantized_modules(skeleton, schemes, split_experts=bool(qc.get("split_experts")))
            _check_architecture(skeleton, qc, problems["loader"])
        else:  # the importer's conversion is the loader of these folders
            skeleton = convert_foreign(folder, config, qc, tensors)[0]
    except QuantkitError as exc:
        problems["loader"].append(str(exc))
        return verdict
    _check_tensors(skeleton, _without_mtp(tensors, config, qc, problems), problems)
    if baseline is not None and verdict.ok:
        verdict.figures = compare_with_baseline(folder, method, baseline, data, windows, seqlen, device)
        verdict.figures.update(max_kl=max_kl, min_top1=min_top1)
        kl, top1 = verdict.figures["kl"], verdict.figures["top1_agreement"]
        found = problems.setdefault("baseline", [])
        if kl > max_kl:
            found.append(f"KL {kl:.4f} > {max_kl}")
        if top1 < min_top1:
            found.append(f"top-1 agreement {top1:.3f} < {min_top1}")
    return verdict


def _check_architecture(skeleton, qc: dict, found: list[str]) -> None:
    from quantkit.models.arch import arch_for
    from quantkit.quant.scheme import QuantScheme

    for name, data in qc["schemes"].items():  # a scheme edited in place keeps its old name
        described = QuantScheme.from_dict(data).name
        if described != name:
            found.append(f"quantization_config scheme {name} describes {described}")
    recorded = qc.get("architecture")
    actual = arch_for(skeleton).name
    if recorded is not None and recorded != actual:
        found.append(f"quantization_config says architecture {recorded}, config.json builds {actual}")


def _without_mtp(tensors, config: dict, qc: dict, problems: dict) -> dict:
    """The tensors less the multi-token-prediction layers (no Hugging Face model holds them: they are carried for
    MTP drafting, checked here for their count and finite values): those ``quantization_config.mtp`` names in a
    quantkit folder; in other tools' folders (DeepSeek-V3's own, an export) the layers past ``num_hidden_layers``,
    as the importer finds them."""
    mtp = qc.get("mtp") or {}
    layers = mtp.get("layers") or ([] if qc.get("quant_method") == QUANT_METHOD else mtp_layers(config, tensors))
    heads = tuple(f"{p}." for p in layers)
    if not heads:
        return tensors
    names = [n for n in tensors if n.startswith(heads)]
    if len(names) != mtp.get("tensors", len(names)):
        problems["coverage"].append(
            f"MTP layers hold {len(names)} tensors, quantization_config.mtp says {mtp['tensors']}"
        )
    for n in names:
        t = tensors[n]
        if t.is_floating_point() and not bool(torch.isfinite(t.float()).all()):
            problems["finite"].append(f"{n} has NaN or Inf")
    return _Only(tensors, [n for n in tensors if not n.startswith(heads)])


class _Only(Mapping):
    """The tensors of ``tensors`` named in ``names``, read on demand as ``tensors`` reads them."""

    def __init__(self, tensors, names: list[str]) -> None:
        self.tensors, self.names = tensors, names
        self._set = set(names)

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._set:
            raise KeyError(name)
        return self.tensors[name]

    def __iter__(self):
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


def _check_tensors(skeleton: torch.nn.Module, tensors: dict[str, torch.Tensor], problems: dict) -> None:
    expected = skeleton.state_dict()
    tied = set(getattr(skeleton, "all_tied_weights_keys", None) or {})
    problems["coverage"] += [f"missing {n}" for n in sorted(set(expected) - set(tensors) - tied)]
    problems["coverage"] += [f"unused {n}" for n in sorted(set(tensors) - set(expected))]
    quantized = quantized_modules(skeleton)
    owner = {f"{m}.{k}": (m, mod) for m, mod in quantized.items() for k, _ in mod.named_buffers(recurse=False)}
    for name in sorted(set(expected) & set(tensors)):
        want, got = expected[name], tensors[name]
        if tuple(got.shape) != tuple(want.shape):
            scheme = f" by its scheme {owner[name][1].scheme.name}" if name in owner else ""
            problems["shapes"].append(f"{name} is {list(got.shape)}, expected {list(want.shape)}{scheme}")
            continue
        if name in owner and got.dtype != want.dtype:
            problems["dtypes"].append(f"{name} is {got.dtype}, the layer reads {want.dtype}")
        if got.dtype.is_floating_point and not bool(torch.isfinite(got.float()).all()):
            problems["finite"].append(f"{name} holds NaN or infinity")
    for module_name, module in quantized.items():
        layer = {k: tensors.get(f"{module_name}.{k}") for k, _ in module.named_buffers(recurse=False)}
        if any(
            t is None or tuple(t.shape) != tuple(b.shape)
            for (_, b), t in zip(module.named_buffers(recurse=False), layer.values(), strict=True)
        ):
            continue  # reported above
        _check_module(module_name, module, layer, problems)


def _check_module(name: str, module, layer: dict[str, torch.Tensor], problems: dict) -> None:
    scheme = module.scheme
    for key in ("scales", "weight_scale", "input_scale"):
        t = layer.get(key)
        if t is not None and t.is_floating_point() and bool((t.float() <= 0).any()):
            problems["scales"].append(f"{name}.{key} holds scales <= 0")
    if scheme.progressive:
        _check_progressive(name, module, layer, problems)
    if not scheme.packed:
        return
    b, n, k = scheme.bits, module.out_features, module.in_features
    qzeros = layer["qzeros"]
    if qzeros.dtype == torch.int32:
        zeros = unpack_cols(qzeros, b, qzeros.shape[1] * 32 // b)  # every code of the words, padding included
        if bool((zeros[:, n:] != 0).any()):
            problems["zero_points"].append(f"{name}.qzeros has bits set beyond its {n} outputs")
        if scheme.sym and not bool((zeros[:, :n] == 2 ** (b - 1)).all()):
            bad = int((zeros[:, :n] != 2 ** (b - 1)).sum())
            problems["zero_points"].append(f"{name}: {bad} zero points are not {2 ** (b - 1)} (symmetric {b}-bit)")
    g_idx = layer["g_idx"]
    n_g, size = scheme.n_groups(k), scheme.group_of(k)
    if g_idx.dtype != torch.int32:
        return
    if g_idx.numel() and (int(g_idx.min()) < 0 or int(g_idx.max()) >= n_g):
        problems["g_idx"].append(f"{name}.g_idx names groups outside [0, {n_g})")
        return
    counts = torch.bincount(g_idx.long(), minlength=n_g)
    want = torch.full((n_g,), size, dtype=counts.dtype)
    want[-1] = k - size * (n_g - 1)
    if not torch.equal(counts, want):
        problems["g_idx"].append(f"{name}.g_idx gives groups of {counts.min()}..{counts.max()} inputs, the scheme "
                                 f"{scheme.name} groups of {size}")  # fmt: skip


def _check_progressive(name: str, module, layer: dict[str, torch.Tensor], problems: dict) -> None:
    """The progressive grid's ranges (``quantkit.nn.progressive``), on tensors of the shapes and dtypes the layer
    reads (others are reported as such)."""
    from quantkit.nn.progressive import grid_problems

    if any(layer[key].dtype != buf.dtype for key, buf in module.named_buffers(recurse=False)):
        return
    args = (layer[key] for key in ("group_scale", "group_zero", "perm", "qweight"))
    for kind, what in grid_problems(*args, module.scheme.group_size):
        problems[kind].append(f"{name}.{what}")


def compare_with_baseline(folder: Path, method: str, baseline: str, data: str, windows: int, seqlen: int,
                          device: str) -> dict:  # fmt: skip
    """KL, top-1 agreement and perplexities of the checkpoint in ``folder`` against the float ``baseline`` on the
    first ``windows`` windows of ``seqlen`` tokens of ``data``. Other tools' folders are imported into a temporary
    folder first (quantkit's loader then reads them)."""
    from transformers import AutoTokenizer

    from quantkit.calib.data import evaluation_windows
    from quantkit.checkpoint.foreign import import_checkpoint
    from quantkit.checkpoint.load import load_quantized
    from quantkit.eval.perplexity import evaluate_windows
    from quantkit.models.loading import load_model, loading

    with tempfile.TemporaryDirectory(prefix=".quantkit-verify-") as tmp:
        path = folder if method == QUANT_METHOD else import_checkpoint(folder, Path(tmp) / "imported").path
        model = load_quantized(path, dtype=torch.float32, device=device)
        with loading(f"the tokenizer of {folder}"):
            tokenizer = AutoTokenizer.from_pretrained(folder)
    base = load_model(baseline, dtype=torch.float32, device=device)[0]
    if base.config.vocab_size != model.config.vocab_size:
        raise QuantkitError(f"--baseline {baseline} has a vocabulary of {base.config.vocab_size} tokens, the "
                            f"checkpoint {model.config.vocab_size}")  # fmt: skip
    ids, protocol = evaluation_windows(tokenizer, data, seqlen, windows)
    result = evaluate_windows(model, ids, base)
    return {**result.to_dict(), "protocol": protocol}
