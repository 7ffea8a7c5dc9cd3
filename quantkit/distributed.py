"""Calibration across processes with torch.distributed: NCCL between GPUs, gloo on CPUs.

Each rank holds a contiguous shard of the calibration batches (:class:`Shard`) and runs it through the current
decoder layer. Statistics are summed over the ranks in float64 (:func:`reduce_stats`): every rank accumulates its
batches' fp32 products in float64, so the sum does not depend on how the batches were split, and the single-process
run accumulates the same way. Each linear's quantization (RTN, a GPTQ solve) runs once, on an owner rank chosen by
bin-packing the linears by cost (:func:`owners`), and the result is sent to the other ranks
(:func:`broadcast_object`). The next layer's inputs stay on their ranks; rank 0 writes the checkpoint.

Three ways in: ``quantkit quantize --nproc N`` (:func:`launch` spawns N local processes), ``torchrun -m quantkit
quantize`` (:func:`init_from_env` reads RANK / WORLD_SIZE), and :func:`quantkit.quantize` called inside a process
group the caller initialised. Every collective has a timeout (:data:`DEFAULT_TIMEOUT_S`); when one rank fails,
:func:`launch` stops the others and names the rank and its error on one line.
"""

from __future__ import annotations

import contextlib
import io
import logging
import multiprocessing
import os
import socket
import sys
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from quantkit.calib.stats import LinearStats
from quantkit.errors import QuantkitError, one_line

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 1800  # a collective waits this long for the other ranks (torch's own default for gloo)


def world() -> tuple[int, int]:
    """(rank, world size) of the default process group; (0, 1) outside one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def is_main() -> bool:
    """True on rank 0, and outside a process group: the process that prints and writes."""
    return world()[0] == 0


def env_world_size() -> int:
    """WORLD_SIZE as torchrun (or :func:`launch`) sets it; 1 when unset."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        raise QuantkitError(f"WORLD_SIZE must be an integer, got {os.environ['WORLD_SIZE']!r}") from None


def check_processes(nproc: int, device: str) -> int:
    """How many processes a quantize command runs in (``nproc``, or torchrun's WORLD_SIZE); a QuantkitError for
    settings that do not work across processes."""
    env = env_world_size()
    if nproc > 1 and env > 1:
        raise QuantkitError("--nproc under torchrun: torchrun's --nproc-per-node starts the processes")
    ranks = max(nproc, env)
    if ranks > 1 and device.startswith("cuda"):
        if device != "cuda":
            raise QuantkitError(f"--device {device}: across processes each rank takes its own GPU; give --device cuda")
        if nproc > torch.cuda.device_count():
            raise QuantkitError(f"--nproc {nproc} needs a GPU each: this machine has {torch.cuda.device_count()}")
    return ranks


def init_from_env(device: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> str:
    """Join the process group that RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT describe (NCCL for a CUDA
    ``device``, gloo on the CPU) and return the device this rank works on (``cuda:LOCAL_RANK`` for ``cuda``).
    Ranks other than 0 print nothing from then on (their stdout is dropped, their logging keeps errors only)."""
    if dist.is_initialized():
        return device
    local = int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")))
    if device.startswith("cuda"):
        if device != "cuda":
            raise QuantkitError(f"--device {device}: across processes each rank takes its own GPU; give --device cuda")
        if local >= torch.cuda.device_count():
            raise QuantkitError(f"local rank {local} has no GPU: this machine has {torch.cuda.device_count()}")
        device = f"cuda:{local}"
        torch.cuda.set_device(local)
    dist.init_process_group(
        "nccl" if device.startswith("cuda") else "gloo",
        timeout=timedelta(seconds=timeout_s),
        **({"device_id": torch.device(device)} if device.startswith("cuda") else {}),
    )
    if dist.get_rank():
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (for the life of the process)
        logging.disable(logging.WARNING)
    return device


@dataclass(frozen=True)
class Shard:
    """This rank's contiguous share of the calibration batches: ``sizes`` are the windows of every batch, in order;
    the rank holds batches ``start`` to ``stop``. Shares differ by one batch at most, rank 0's being among the
    smaller (it also runs the stages that do not split their work, and writes)."""

    rank: int
    size: int
    sizes: tuple[int, ...]

    @classmethod
    def of(cls, sizes) -> Shard:
        rank, size = world()
        if 0 < len(sizes) < size:
            raise QuantkitError(
                f"{len(sizes)} calibration batches cannot be shared by {size} processes: "
                "use fewer processes, more windows or a smaller calibration batch_size"
            )
        return cls(rank, size, tuple(int(s) for s in sizes))

    def bounds(self, rank: int) -> tuple[int, int]:
        n = len(self.sizes)
        return n * rank // self.size, n * (rank + 1) // self.size

    @property
    def start(self) -> int:
        return self.bounds(self.rank)[0]

    @property
    def stop(self) -> int:
        return self.bounds(self.rank)[1]

    @property
    def first_window(self) -> int:
        """The global index of this rank's first calibration window."""
        return sum(self.sizes[: self.start])

    def owner(self, batch: int) -> int:
        return next(r for r in range(self.size) if self.bounds(r)[0] <= batch < self.bounds(r)[1])


def owners(costs: dict[str, float], size: int, loads: list[float] | None = None) -> dict[str, int]:
    """The rank that computes each item: the costliest first, each to the least loaded rank (ties: the lower rank
    and the earlier name), so that every rank computes the same answer. ``loads`` (per rank, updated in place)
    carries work over from one call to the next."""
    loads = loads if loads is not None else [0.0] * size
    out = {}
    for name in sorted(costs, key=lambda n: (-costs[n], n)):
        rank = min(range(size), key=lambda r: (loads[r], r))
        out[name] = rank
        loads[rank] += costs[name]
    return out


def reduce_(tensors: list[torch.Tensor], op: str = "sum") -> None:
    """Sum (or take the max of) each tensor over the ranks, in place, in one collective: sums in float64."""
    if not tensors:
        return
    dtype = torch.float64 if op == "sum" else tensors[0].dtype
    flat = torch.cat([t.reshape(-1).to(dtype) for t in tensors])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    for t, part in zip(tensors, flat.split([t.numel() for t in tensors]), strict=True):
        t.copy_(part.view_as(t))


def reduce_stats(stats: dict[str, LinearStats]) -> None:
    """Make ``stats`` those of every rank's batches (X^T X, |x| sums and token counts summed, |x| maxima taken).

    Linears fed by one input share one object (:class:`quantkit.calib.stats.StatsCollector`); a rank none of whose
    tokens reached a linear (an expert) cannot know with whom it shares, so the ranks agree on it first."""
    names = sorted(stats)
    local = {n: min(m for m in names if stats[m] is stats[n]) for n in names if stats[n].n_tokens}
    shared: dict[str, str] = {}
    parts: list = [None] * world()[1]
    dist.all_gather_object(parts, local)
    for part in parts:
        shared.update(part)
    for n in names:
        stats[n] = stats[shared.get(n, n)]
    unique = [stats[n] for n in names if shared.get(n, n) == n]
    device = unique[0].absmax.device if unique else torch.device("cpu")
    counts = torch.tensor([float(s.n_tokens) for s in unique], dtype=torch.float64, device=device)
    reduce_([*(s.xtx for s in unique if s.xtx is not None), *(s.abssum for s in unique), counts], "sum")
    reduce_([s.absmax for s in unique], "max")
    for s, n in zip(unique, counts.tolist(), strict=True):
        s.n_tokens = int(n)


def check_same(value, what: str) -> None:
    """Refuse to go on when a rank holds another ``value`` (plain data) than rank 0."""
    parts: list = [None] * world()[1]
    dist.all_gather_object(parts, value)
    for rank, part in enumerate(parts):
        if part != parts[0]:
            raise QuantkitError(f"rank {rank} has other {what} than rank 0: every rank must be given the same")


@contextlib.contextmanager
def named_failures():
    """Across processes, an error inside the block as one QuantkitError line naming this rank and the cause (a rank
    that loses its peers sees a collective fail, or time out); unchanged in a single process."""
    try:
        yield
    except QuantkitError:
        raise
    except Exception as exc:
        rank, size = world()
        if size == 1:
            raise
        raise QuantkitError(f"rank {rank} of {size} failed: {_cause(exc)}") from exc


def in_turn(fn):
    """``fn()`` on rank 0, then on the other ranks (what rank 0 wrote is there for them to read); its result."""
    if world()[1] == 1:
        return fn()
    out = fn() if world()[0] == 0 else None
    dist.barrier()
    return out if world()[0] == 0 else fn()


def broadcast_object(obj, src: int, device: torch.device):
    """``obj`` (tensors, modules, plain data) as rank ``src`` holds it, on every rank, its tensors on ``device``."""
    buf = [None]
    if world()[0] == src:
        data = io.BytesIO()
        torch.save(obj, data)
        buf = [data.getvalue()]
    dist.broadcast_object_list(buf, src=src)
    if world()[0] == src:
        return obj
    return torch.load(io.BytesIO(buf[0]), map_location=device, weights_only=False)


# launching ---------------------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cause(exc: BaseException) -> str:
    if isinstance(exc, QuantkitError):
        return one_line(exc)
    return f"{type(exc).__name__}: {one_line(exc)}"


def _worker(rank: int, size: int, port: int, target, kwargs: dict, threads: int, errors) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(size), LOCAL_WORLD_SIZE=str(size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # fmt: skip
    torch.set_num_threads(threads)
    code = 0
    try:
        target(**kwargs)
    except BaseException as exc:  # every failure is reported to the launcher, then ends the process
        log.debug("rank %d failed", rank, exc_info=True)
        errors.put((time.time(), rank, _cause(exc), getattr(exc, "exit_code", 2)))
        code = 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    sys.exit(code)


def launch(nproc: int, target, kwargs: dict, threads: int | None = None, grace_s: float = 3.0) -> None:
    """Run ``target(**kwargs)`` in ``nproc`` new local processes of one process group (each finds RANK,
    WORLD_SIZE, MASTER_ADDR and MASTER_PORT in its environment, as under torchrun); ``target`` must be importable
    by name (a module-level function); each uses ``threads`` CPU threads (default: its share of this process's).
    Returns when all end well; when one fails, the others are stopped and a QuantkitError names the first rank that
    failed and why."""
    ctx = multiprocessing.get_context("spawn")
    errors = ctx.SimpleQueue()
    port = _free_port()
    threads = threads or max(1, torch.get_num_threads() // nproc)
    procs = [
        ctx.Process(target=_worker, args=(r, nproc, port, target, kwargs, threads, errors), name=f"quantkit-rank{r}")
        for r in range(nproc)
    ]
    for p in procs:
        p.start()
    failed_at, first = None, []
    try:
        while any(p.exitcode is None for p in procs):
            if failed_at is None and any(p.exitcode not in (None, 0) for p in procs):
                failed_at = time.monotonic()  # the others get a moment to report their own errors, then stop
                first = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if failed_at is not None and time.monotonic() - failed_at > grace_s:
                break
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.exitcode is None:
                p.terminate()
        for p in procs:
            p.join()
    reports = []
    while not errors.empty():
        reports.append(errors.get())
    silent = [r for r in first if r not in {rep[1] for rep in reports}]  # killed before it could say why
    if reports and not silent:
        _, rank, cause, code = min(reports)
        named = f"rank {rank} of {nproc} failed: "
        err = QuantkitError(cause if cause.startswith(named) else named + cause)
        err.exit_code = code if isinstance(code, int) and code > 0 else 2
        raise err
    bad = [(r, procs[r].exitcode) for r in silent] or [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode]
    if bad:
        rank, code = bad[0]
        why = f"killed by signal {-code}" if code < 0 else f"exit status {code}"
        raise QuantkitError(f"rank {rank} of {nproc} failed: {why} (out of memory?)")
