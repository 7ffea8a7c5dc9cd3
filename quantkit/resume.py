"""Resume state: what a quantize run needs to go on after a crash, persisted after every decoder layer.

A state folder (the CLI's: ``.OUT.resume`` beside the output) holds

- ``layer-NNNNN.safetensors``: decoder layer NNNNN as quantized (its whole state dict; the metadata names the
  scheme of each quantized linear), one file per layer done;
- ``hidden-NNNNN.safetensors``: the inputs of layer NNNNN for every calibration batch (the outputs of the quantized
  layer before it), and the torch RNG states, for the next layer only;
- ``state.json``: the run's fingerprint, how many layers are done, and the per-linear report so far.

Each file is written under a temporary name and renamed into place; ``state.json`` is replaced last, so a crash at
any moment leaves the previous complete layer's state (files it does not name are deleted when the state opens).
The files are written on a background thread while the next layer runs: ``save`` copies what it needs off the GPU
(on a side stream, into pinned memory) and returns; the write before it is waited for first, so at most one layer is
in flight, and :meth:`RunState.flush` waits for the last. A crash loses at most the layer being written.
The fingerprint covers the model's files (name, size and modification time of each; the weights themselves when the
model has no folder), the recipe (less its quality gate, which does not change the layers), the calibration windows
and their provenance, the device and the quantkit / torch / transformers versions. A run continues from the state
only when all of them match, and refuses with a line that names what differs otherwise; the checkpoint it then
writes is byte for byte the one an uninterrupted run writes.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from quantkit.checkpoint.save import stream_safetensors, versions
from quantkit.errors import QuantkitError
from quantkit.nn.factory import empty_quantized_linear, quantized_modules
from quantkit.quant.scheme import QuantScheme

STATE_VERSION = 1
STATE_FILE = "state.json"
MODEL_FILES = (".safetensors", ".bin", ".json", ".gguf", ".model", ".txt")  # what a load reads from a model folder


def _digest(data: bytes | str) -> str:
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()[:16]


def model_digest(model: nn.Module) -> str:
    """The model's files (name, size, modification time), or its weights when it has no folder, its config and the
    dtypes it was loaded in."""
    config = getattr(model, "config", None)
    dtypes = sorted({str(p.dtype) for p in model.parameters()})  # what it was loaded as
    parts = [json.dumps(config.to_dict(), sort_keys=True, default=str) if config is not None else "", *dtypes]
    folder = Path(str(getattr(config, "_name_or_path", "") or ""))
    if str(folder) not in ("", ".") and folder.is_dir():
        for f in sorted(folder.iterdir()):
            if f.is_file() and f.suffix in MODEL_FILES:
                st = f.stat()
                parts.append(f"{f.name}:{st.st_size}:{st.st_mtime_ns}")
    else:  # every weight hashed, on several threads (hashlib lets go of the GIL): 16 GB of an 8B model in seconds
        tensors = [(name, t) for name, t in model.state_dict().items() if t.device.type != "meta"]
        with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
            parts.append(hashlib.sha256(b"".join(pool.map(_tensor_digest, tensors))).hexdigest())
    return _digest("\n".join(parts))


def _tensor_digest(item: tuple[str, torch.Tensor]) -> bytes:
    name, t = item
    h = hashlib.sha256(name.encode())
    h.update(memoryview(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()))  # no copy on the CPU
    return h.digest()


def run_fingerprint(model: nn.Module, recipe, calib: torch.Tensor | None, calibration: dict | None, device) -> dict:
    """What a run's result depends on, one digest per part (the names :meth:`RunState.open` reports)."""
    recipe_data = recipe.to_dict()
    recipe_data.pop("gate", None)
    calib_bytes = b"" if calib is None else calib.detach().cpu().contiguous().numpy().tobytes()
    return {
        "model": model_digest(model),
        "recipe": _digest(json.dumps(recipe_data, sort_keys=True)),
        "calibration data": _digest(calib_bytes + json.dumps(calibration, sort_keys=True, default=str).encode()),
        "device": str(device),
        "versions": _digest(json.dumps(versions(), sort_keys=True)),
    }


def _replace(path: Path, write) -> None:
    """``write(tmp)`` then rename ``tmp`` to ``path``: the file appears whole or not at all."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


class RunState:
    """The resume state of one run in ``folder`` (see the module doc)."""

    def __init__(self, folder: Path, fingerprint: dict, done: int = 0, report: dict | None = None) -> None:
        self.folder = folder
        self.fingerprint = fingerprint
        self.done = done  # layers complete
        self.resumed = done  # layers restored when the run began
        self.saves = 0
        self.report: dict[str, dict] = report or {}
        self.bytes_written = 0  # by save, for the overhead figures
        self.seconds = 0.0  # the run's time inside save and flush: copies off the GPU, waits for the writer
        self._writer: threading.Thread | None = None
        self._failure: BaseException | None = None
        self._stream = None  # the CUDA stream that copies off the GPU
        self.writes = True  # False: a reader (a rank other than 0) that saves and clears nothing

    @classmethod
    def open(cls, folder: str | os.PathLike, fingerprint: dict, resume: bool, writes: bool = True) -> RunState:
        """The state in ``folder``: with ``resume``, the saved one when there is one (refused when its fingerprint
        differs), else a fresh one; without, always a fresh one (an old state is deleted). ``writes`` False (ranks
        other than 0 across processes): read the state that the writing rank opened, never change the folder."""
        folder = Path(folder)
        if not writes:
            path = folder / STATE_FILE
            saved = json.loads(path.read_text()) if resume and path.is_file() else None
            state = cls(folder, fingerprint, saved["done"], saved["report"]) if saved else cls(folder, fingerprint)
            state.writes = False
            return state
        path = folder / STATE_FILE
        if folder.exists() and (not folder.is_dir() or (any(folder.iterdir()) and not path.is_file())):
            raise QuantkitError(f"{folder} is not a resume state folder: refusing to use it")
        saved = None
        if resume and path.is_file():
            try:
                saved = json.loads(path.read_text())
                if saved.get("version") != STATE_VERSION:
                    raise QuantkitError(f"cannot resume from {folder}: state version {saved.get('version')}")
            except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
                raise QuantkitError(f"cannot resume from {folder}: {STATE_FILE} is damaged (delete it)") from None
            differ = [k for k in fingerprint if saved["fingerprint"].get(k) != fingerprint[k]]
            if differ:
                verb = "differs" if len(differ) == 1 else "differ"
                raise QuantkitError(f"cannot resume from {folder}: the {' and the '.join(differ)} {verb} from the "
                                    "interrupted run's (run without --resume to start again)")  # fmt: skip
        elif folder.exists():
            shutil.rmtree(folder)
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise QuantkitError(f"cannot write resume state in {folder}: {exc.strerror or exc}") from None
        state = cls(folder, fingerprint, saved["done"], saved["report"]) if saved else cls(folder, fingerprint)
        state._tidy()
        return state

    def _layer_file(self, i: int) -> Path:
        return self.folder / f"layer-{i:05d}.safetensors"

    def _hidden_file(self, i: int) -> Path:
        return self.folder / f"hidden-{i:05d}.safetensors"

    def _tidy(self) -> None:
        """Delete what ``state.json`` does not name (a crash between writing a file and naming it)."""
        keep = {STATE_FILE, self._hidden_file(self.done).name} | {self._layer_file(i).name for i in range(self.done)}
        for f in self.folder.iterdir():
            if f.name not in keep:
                f.unlink()

    def restore(self, layers: nn.ModuleList, prepare) -> None:
        """Put back the quantized layers done (``prepare(layer)`` first, as the run did) and the RNG states."""
        for i in range(self.done):
            prepare(layers[i])
            home = next(layers[i].parameters(), torch.empty(0)).device
            restore_layer(layers[i], self._layer_file(i))
            layers[i].to(home)
        if self.done:
            with safe_open(str(self._hidden_file(self.done)), framework="pt") as f:
                torch.set_rng_state(f.get_tensor("rng.cpu"))
                if torch.cuda.is_available() and "rng.cuda" in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    torch.cuda.set_rng_state(f.get_tensor("rng.cuda"))

    def hidden(self, device: torch.device) -> list[torch.Tensor] | None:
        """The inputs of the first layer still to do, per calibration batch (None for a fresh run)."""
        if not self.done:
            return None
        with safe_open(str(self._hidden_file(self.done)), framework="pt") as f:
            n = sum(1 for k in f.keys() if k.startswith("batch."))  # noqa: SIM118
            return [f.get_tensor(f"batch.{b}").to(device) for b in range(n)]

    def save(self, i: int, layer: nn.Module, hidden: list[torch.Tensor], report: dict) -> None:
        """Record layer ``i`` as done: the quantized layer, the next layer's inputs, the report so far, the RNG.

        Returns once the tensors are copied (GPU copies are queued on a side stream); a background thread writes
        them. A write error is raised here or by :meth:`flush`, whichever comes next."""
        if not self.writes:
            self.done = i + 1
            return
        t0 = time.perf_counter()
        self.flush()
        snapshot = self._snapshot(layer, hidden)
        self._writer = threading.Thread(
            target=self._write_in_background, args=(i, *snapshot, dict(report)), name=f"quantkit-resume-{i}"
        )
        self._writer.start()
        self.seconds += time.perf_counter() - t0

    def flush(self) -> None:
        """Wait until the last layer saved is on disk; raise its write error, if any."""
        if self._writer is None:
            return
        t0 = time.perf_counter()
        self._writer.join()
        self._writer = None
        self.seconds += time.perf_counter() - t0
        failure, self._failure = self._failure, None
        if isinstance(failure, OSError):  # a full disk: the state stays at the last layer written whole
            raise QuantkitError(f"cannot write resume state in {self.folder}: {failure.strerror or failure} "
                                "(--no-resume-state runs without it)") from None  # fmt: skip
        if failure is not None:
            raise failure

    def _snapshot(self, layer: nn.Module, hidden: list[torch.Tensor]):
        """Host copies of what the files hold (the run goes on changing its own), and an event that says when the
        copies off the GPU are complete."""
        schemes = {name: m.scheme.to_dict() for name, m in quantized_modules(layer).items()}
        state = layer.state_dict()
        on_gpu = [t for t in [*state.values(), *hidden] if t.is_cuda]
        event = None
        if on_gpu:
            device = on_gpu[0].device
            if self._stream is None:
                self._stream = torch.cuda.Stream(device)
            self._stream.wait_stream(torch.cuda.current_stream(device))  # the tensors as the run last wrote them
            event = torch.cuda.Event()

        def host(t: torch.Tensor) -> torch.Tensor:
            t = t.detach()
            if not t.is_cuda:
                return t.clone()
            t.record_stream(self._stream)  # not reused by the run before the copy is done
            with torch.cuda.stream(self._stream):
                return t.to("cpu", non_blocking=True)  # pinned memory: the copy runs beside the next layer

        tensors = {k: host(t) for k, t in state.items()}
        carried = {f"batch.{b}": host(h) for b, h in enumerate(hidden)}
        carried["rng.cpu"] = torch.get_rng_state()
        if torch.cuda.is_available():
            carried["rng.cuda"] = torch.cuda.get_rng_state()
        if event is not None:
            event.record(self._stream)
        return tensors, schemes, carried, event

    def _write_in_background(self, i: int, tensors: dict, schemes: dict, carried: dict, event, report: dict) -> None:
        try:
            if event is not None:
                event.synchronize()
            self._write(i, tensors, schemes, carried, report)
            self.done = i + 1
            self.saves += 1
            self.bytes_written += self._layer_file(i).stat().st_size + self._hidden_file(i + 1).stat().st_size
        except BaseException as exc:  # handed to the run's thread by flush
            self._failure = exc

    def _write(self, i: int, tensors: dict, schemes: dict, carried: dict, report: dict) -> None:
        _replace(self._layer_file(i), lambda p: write_tensors(tensors, p, {"schemes": json.dumps(schemes)}))
        _replace(self._hidden_file(i + 1), lambda p: write_tensors(carried, p))
        state = {"version": STATE_VERSION, "fingerprint": self.fingerprint, "done": i + 1, "report": report}
        _replace(self.folder / STATE_FILE, lambda p: p.write_text(json.dumps(state)))
        self._hidden_file(i).unlink(missing_ok=True)

    def clear(self) -> None:
        """Delete the state (the checkpoint is written)."""
        if not self.writes:
            return
        self.flush()
        shutil.rmtree(self.folder, ignore_errors=True)


def write_tensors(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None) -> None:
    """How the state's files are written (one name for tests to stand a full disk in for)."""
    stream_safetensors(tensors, path, metadata)


def restore_layer(layer: nn.Module, path: Path) -> None:
    """Swap the quantized modules named in ``path`` into ``layer`` and load the saved state dict into it."""
    with safe_open(str(path), framework="pt") as f:
        schemes = json.loads(f.metadata()["schemes"])
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    for name, data in schemes.items():
        old = layer.get_submodule(name)
        scheme = QuantScheme.from_dict(data)
        dtype = old.weight.dtype
        new = empty_quantized_linear(old.in_features, old.out_features, scheme, old.bias is not None, dtype, "cpu")
        layer.set_submodule(name, new)
    layer.load_state_dict(tensors, strict=True, assign=True)
