"""Text for calibration and evaluation, cut into token windows.

A source is one of
- a shipped name (``brown``: the default calibration text; ``moby-dick``: the default evaluation text; see
  ``calib_data/manifest.json`` for sources, licences and sha256),
- local files: ``.txt``, ``.json``, ``.jsonl`` or ``.parquet`` (read through ``datasets``; JSON/parquet use the
  ``text`` column, or the only string column), several joined with commas,
- ``hf:NAME[:CONFIG][:SPLIT]`` -- a Hugging Face hub dataset, for users who are online.

The text is tokenized once without special tokens (no BOS) and cut into non-overlapping windows of ``seqlen``
tokens. Calibration takes ``nsamples`` windows chosen at random with ``seed`` (reproducible); evaluation takes
the first windows in order.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import urllib.parse
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import torch

from quantkit.errors import QuantkitError, one_line

DEFAULT_CALIB = "brown"
DEFAULT_EVAL = "moby-dick"
LOCAL_SUFFIXES = {".txt": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}


def shipped_manifest() -> dict:
    return json.loads(resources.files("quantkit.calib_data").joinpath("manifest.json").read_text())


@dataclass(frozen=True)
class TextSource:
    """Where a text came from, recorded in checkpoints and evaluation reports."""

    source: str
    sha256: str
    detail: dict = field(default_factory=dict)


def _read_local(paths: list[Path]) -> str:
    import datasets

    for p in paths:
        if not p.is_file():
            raise QuantkitError(f"text file not found: {p}")
        if p.suffix not in LOCAL_SUFFIXES:
            raise QuantkitError(f"unsupported text file {p.name}; use one of {', '.join(LOCAL_SUFFIXES)}")
    builders = {LOCAL_SUFFIXES[p.suffix] for p in paths}
    if len(builders) > 1:
        raise QuantkitError("give text files of one kind at a time (txt, json/jsonl or parquet)")
    builder = builders.pop()
    kwargs = {"sample_by": "document"} if builder == "text" else {}
    try:
        ds = datasets.load_dataset(builder, data_files=[str(p) for p in paths], split="train", **kwargs)
    except Exception as exc:  # datasets raises many types for unreadable files, often wrapping the parser's error
        cause = exc.__cause__ or exc.__context__ or exc
        raise QuantkitError(f"could not read {', '.join(map(str, paths))}: {one_line(cause)}") from None
    return _join_text_column(ds, ", ".join(map(str, paths)))


def _join_text_column(ds, where: str) -> str:
    string_columns = [name for name, feat in ds.features.items() if getattr(feat, "dtype", None) == "string"]
    column = "text" if "text" in ds.column_names else (string_columns[0] if len(string_columns) == 1 else None)
    if column is None:
        raise QuantkitError(f"{where}: no 'text' column (columns: {', '.join(ds.column_names)})")
    return "\n\n".join(t for t in ds[column] if t)


def _check_hub_reachable(spec: str, timeout: float = 5.0) -> None:
    """Fail in a second, not after datasets' ~25 s of retries, when the hub cannot be reached: no route to its host
    and no proxy to go through. With HF_HUB_OFFLINE=1 datasets reads its cache and this check is skipped."""
    from huggingface_hub import constants

    proxies = ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")
    if constants.HF_HUB_OFFLINE or any(os.environ.get(v) for v in proxies):
        return
    url = urllib.parse.urlsplit(constants.ENDPOINT)
    try:
        socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)), timeout).close()
    except OSError as exc:
        raise QuantkitError(
            f"could not load hub dataset {spec!r}: {constants.ENDPOINT} is unreachable ({exc.strerror or exc}); "
            "give a local file, or set HF_HUB_OFFLINE=1 to read a dataset already in the datasets cache"
        ) from None


def _read_hub(spec: str) -> str:
    import datasets

    name, config, split = [*spec.split(":"), None, None][:3]
    _check_hub_reachable(spec)
    try:
        ds = datasets.load_dataset(name, config, split=split or "train")
    except Exception as exc:
        raise QuantkitError(f"could not load hub dataset {spec!r} (are you online?): {one_line(exc)}") from None
    return _join_text_column(ds, f"hf:{spec}")


def load_text(source: str) -> tuple[str, TextSource]:
    """The whole text of ``source`` and its fingerprint."""
    manifest = shipped_manifest()
    if source in manifest:
        entry = manifest[source]
        text = resources.files("quantkit.calib_data").joinpath(entry["file"]).read_text(encoding="utf-8")
        digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
        if digest != entry["sha256"]:
            raise QuantkitError(f"shipped text {entry['file']} is corrupt (sha256 mismatch); reinstall quantkit")
        return text, TextSource(source, digest, {"licence": entry["licence"], "origin": entry["source"]})
    if source.startswith("hf:"):
        text = _read_hub(source[3:])
    else:
        paths = [Path(p).expanduser() for p in source.split(",")]
        if not all(p.exists() for p in paths):
            missing = next(p for p in paths if not p.exists())
            raise QuantkitError(
                f"text source not found: {missing} (give a file, one of the shipped texts "
                f"{', '.join(manifest)}, or hf:NAME[:CONFIG][:SPLIT])"
            )
        text = _read_local(paths)
    return text, TextSource(source, hashlib.sha256(text.encode("utf-8")).hexdigest())


def tokenize(tokenizer, text: str) -> torch.Tensor:
    """All tokens of ``text`` (no special tokens) as int64 [n]."""
    ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
    return torch.tensor(ids, dtype=torch.long)


def calibration_windows(tokenizer, source: str, nsamples: int, seqlen: int, seed: int = 0) -> tuple[torch.Tensor, dict]:
    """``nsamples`` random non-overlapping windows [nsamples, seqlen] and the calibration fingerprint."""
    if nsamples < 1 or seqlen < 2:
        raise QuantkitError(f"need nsamples >= 1 and seqlen >= 2, got {nsamples} and {seqlen}")
    text, src = load_text(source)
    ids = tokenize(tokenizer, text)
    slots = ids.numel() // seqlen
    if slots < nsamples:
        raise QuantkitError(
            f"calibration text {source!r} has {ids.numel()} tokens; {nsamples} samples of {seqlen} tokens "
            f"need {nsamples * seqlen}. Use a longer text or fewer/shorter samples"
        )
    g = torch.Generator().manual_seed(seed)
    chosen = torch.randperm(slots, generator=g)[:nsamples].sort().values
    windows = ids[: slots * seqlen].view(slots, seqlen)[chosen]
    fingerprint = {
        "source": src.source,
        "sha256": src.sha256,
        "nsamples": nsamples,
        "seqlen": seqlen,
        "seed": seed,
        "tokens": nsamples * seqlen,
    }
    return windows, fingerprint


def evaluation_windows(tokenizer, source: str, seqlen: int, max_windows: int | None) -> tuple[torch.Tensor, dict]:
    """The first ``max_windows`` non-overlapping windows [n, seqlen] of ``source`` (all when None)."""
    text, src = load_text(source)
    ids = tokenize(tokenizer, text)
    n = ids.numel() // seqlen
    if max_windows is not None:
        n = min(n, max_windows)
    if n < 1:
        raise QuantkitError(f"evaluation text {source!r} has {ids.numel()} tokens, fewer than seqlen {seqlen}")
    return ids[: n * seqlen].view(n, seqlen), {
        "source": src.source,
        "sha256": src.sha256,
        "seqlen": seqlen,
        "windows": n,
    }
