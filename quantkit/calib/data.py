"""Text for calibration and evaluation, cut into token windows.

A source is one of
- a shipped name (``brown``: the default calibration text; ``moby-dick``: the default evaluation text; see
  ``calib_data/manifest.json`` for sources, licences and sha256),
- local files: ``.txt``, ``.json``, ``.jsonl`` or ``.parquet`` (read through ``datasets``; JSON/parquet use the
  ``text`` column, or the only string column), several joined with commas,
- ``hf:NAME[:CONFIG][:SPLIT]`` -- a Hugging Face hub dataset, for users who are online.

The text is tokenized once without special tokens and cut into non-overlapping windows. Calibration takes
``nsamples`` windows chosen at random with ``seed`` (reproducible); evaluation takes the first windows in order.

BOS, one rule for every family: a window is always ``seqlen`` tokens. Where the tokenizer puts BOS in front of a
text by default (Llama 3, Gemma, Mistral; found by tokenizing a probe with and without special tokens, so a
post-processor counts as much as ``add_bos_token``), every window is BOS followed by ``seqlen - 1`` text tokens;
where it does not (SmolLM2, Qwen2), every window is ``seqlen`` text tokens. ``bos=True`` / ``False`` overrides
the tokenizer; the choice is recorded as ``bos`` in the calibration fingerprint and the evaluation protocol.

Chat-formatted calibration (``chat_template=True``, for instruct models): each window's text is split in two,
rendered through ``tokenizer.apply_chat_template`` as a user turn and the assistant's answer, tokenized and cut to
``seqlen`` (a rendering shorter than that is completed with the text that follows the window). What the template
renders is kept as it is (a template that starts with BOS keeps it; SmolLM2's BOS token is its ``<|im_start|>``);
BOS is put in front only where the rule above asks for it and the rendering does not start with it. The
fingerprint's ``bos`` then says whether every window starts with the BOS token.
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
    for p in paths:
        if not p.is_file():
            raise QuantkitError(f"text file not found: {p}")
        if p.suffix not in LOCAL_SUFFIXES:
            raise QuantkitError(f"unsupported text file {p.name}; use one of {', '.join(LOCAL_SUFFIXES)}")
    builders = {LOCAL_SUFFIXES[p.suffix] for p in paths}
    if len(builders) > 1:
        raise QuantkitError("give text files of one kind at a time (txt, json/jsonl or parquet)")
    builder = builders.pop()
    if builder == "text":  # each file whole, as datasets' text builder reads documents; no datasets needed
        texts = []
        for p in paths:
            try:
                texts.append(p.read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError) as exc:
                raise QuantkitError(f"could not read {p}: {one_line(exc)}") from None
        return "\n\n".join(t for t in texts if t)
    import datasets

    kwargs = {}
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


BOS_PROBE = "Hello"


def default_bos(tokenizer) -> bool:
    """Whether ``tokenizer`` puts its BOS in front of a text by default: a probe tokenized with special tokens
    starts with ``bos_token_id`` and without them does not. This reads what the tokenizer does (``add_bos_token``,
    a Llama-3 style ``TemplateProcessing`` post-processor, Gemma's), not what its config claims."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return False
    with_special = tokenizer(BOS_PROBE, add_special_tokens=True, verbose=False)["input_ids"]
    plain = tokenizer(BOS_PROBE, add_special_tokens=False, verbose=False)["input_ids"]
    return with_special[:1] == [bos] and plain[:1] != [bos]


def resolve_bos(tokenizer, bos: bool | str = "auto") -> int | None:
    """The BOS id every window starts with, or None: ``"auto"`` follows :func:`default_bos`, True / False force it."""
    if not isinstance(bos, bool) and bos != "auto":
        raise QuantkitError(f"bos must be 'auto', true or false, got {bos!r}")
    if bos == "auto":
        bos = default_bos(tokenizer)
    if not bos:
        return None
    bos_id = getattr(tokenizer, "bos_token_id", None)
    if bos_id is None:
        raise QuantkitError("bos is on but the tokenizer has no BOS token (bos_token_id is None); use bos: auto")
    return int(bos_id)


def text_windows(ids: torch.Tensor, seqlen: int, bos_id: int | None) -> torch.Tensor:
    """Non-overlapping windows [n, seqlen] of the token stream ``ids`` [T]: ``seqlen`` text tokens each, or BOS
    followed by ``seqlen - 1`` text tokens when ``bos_id`` is given."""
    width = seqlen - (bos_id is not None)
    n = ids.numel() // width
    windows = ids[: n * width].view(n, width)
    if bos_id is None:
        return windows
    return torch.cat([torch.full((n, 1), bos_id, dtype=ids.dtype), windows], dim=1)


def check_chat_template(tokenizer) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise QuantkitError("chat_template calibration needs a tokenizer with a chat template; this one has none")


def chat_window(tokenizer, text_ids: torch.Tensor, following: torch.Tensor, seqlen: int, bos_id: int | None):
    """One calibration window [seqlen] rendered through the chat template: the first half of ``text_ids`` as the
    user's turn, the second half as the assistant's answer; completed with ``following`` when shorter."""
    half = text_ids.numel() // 2
    messages = [
        {"role": "user", "content": tokenizer.decode(text_ids[:half].tolist())},
        {"role": "assistant", "content": tokenizer.decode(text_ids[half:].tolist())},
    ]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    ids = tokenize(tokenizer, rendered)
    if bos_id is not None and (ids.numel() == 0 or int(ids[0]) != bos_id):
        ids = torch.cat([torch.tensor([bos_id]), ids])
    if ids.numel() < seqlen:
        ids = torch.cat([ids, following[: seqlen - ids.numel()]])
    return ids[:seqlen]


def chat_windows(tokenizer, slots: torch.Tensor, chosen: list[int], seqlen: int, bos_id: int | None) -> torch.Tensor:
    """Slots ``chosen`` of ``slots`` [n, seqlen] (text windows) rendered through the chat template, each completed
    with the text of the slot after it (the first one after the last)."""
    following = slots.roll(-1, dims=0)
    return torch.stack([chat_window(tokenizer, slots[i], following[i], seqlen, bos_id) for i in chosen])


def calibration_windows(
    tokenizer,
    source: str,
    nsamples: int,
    seqlen: int,
    seed: int = 0,
    *,
    bos: bool | str = "auto",
    chat_template: bool = False,
) -> tuple[torch.Tensor, dict]:
    """``nsamples`` random non-overlapping windows [nsamples, seqlen] and the calibration fingerprint (see the
    module docstring for ``bos`` and ``chat_template``)."""
    if nsamples < 1 or seqlen < 2:
        raise QuantkitError(f"need nsamples >= 1 and seqlen >= 2, got {nsamples} and {seqlen}")
    if chat_template:
        check_chat_template(tokenizer)
    bos_id = resolve_bos(tokenizer, bos)
    text, src = load_text(source)
    ids = tokenize(tokenizer, text)
    # a chat window is made from seqlen text tokens (the template's own tokens then replace some of them)
    slots = text_windows(ids, seqlen, None if chat_template else bos_id)  # [slots, seqlen]
    if slots.shape[0] < nsamples:
        raise QuantkitError(
            f"calibration text {source!r} has {ids.numel()} tokens; {nsamples} samples of {seqlen} tokens "
            f"need {nsamples * seqlen}. Use a longer text or fewer/shorter samples"
        )
    g = torch.Generator().manual_seed(seed)
    chosen = torch.randperm(slots.shape[0], generator=g)[:nsamples].sort().values
    if chat_template:
        windows = chat_windows(tokenizer, slots, chosen.tolist(), seqlen, bos_id)
    else:
        windows = slots[chosen]
    bos_token = getattr(tokenizer, "bos_token_id", None)
    fingerprint = {
        "source": src.source,
        "sha256": src.sha256,
        "nsamples": nsamples,
        "seqlen": seqlen,
        "seed": seed,
        "tokens": nsamples * seqlen,
        "bos": bos_id is not None
        or (chat_template and bos_token is not None and bool((windows[:, 0] == bos_token).all())),
    }
    if chat_template:
        fingerprint["chat_template"] = True
    return windows, fingerprint


def evaluation_windows(
    tokenizer,
    source: str,
    seqlen: int,
    max_windows: int | None,
    bos: bool | str = "auto",
    *,
    chat_template: bool = False,
) -> tuple[torch.Tensor, dict]:
    """The first ``max_windows`` non-overlapping windows [n, seqlen] of ``source`` (all when None); with BOS
    (see the module docstring) each is BOS + ``seqlen - 1`` text tokens. ``chat_template``: each window rendered
    as a user turn and the assistant's answer, as chat calibration renders them."""
    if chat_template:
        check_chat_template(tokenizer)
    bos_id = resolve_bos(tokenizer, bos)
    text, src = load_text(source)
    ids = tokenize(tokenizer, text)
    windows = text_windows(ids, seqlen, None if chat_template else bos_id)
    if max_windows is not None:
        windows = windows[: max_windows + chat_template]  # a chat window may borrow from the one after it
    if windows.shape[0] < 1 + chat_template:
        raise QuantkitError(f"evaluation text {source!r} has {ids.numel()} tokens, too few for seqlen {seqlen}")
    protocol = {"source": src.source, "sha256": src.sha256, "seqlen": seqlen}
    if chat_template:  # the last slot taken only lends its text to the one before it
        windows = chat_windows(tokenizer, windows, list(range(windows.shape[0] - 1)), seqlen, bos_id)
        bos_token = getattr(tokenizer, "bos_token_id", None)
        protocol["bos"] = bos_token is not None and bool((windows[:, 0] == bos_token).all())
        protocol["chat_template"] = True
    else:
        protocol["bos"] = bos_id is not None
    return windows, {**protocol, "windows": windows.shape[0]}
