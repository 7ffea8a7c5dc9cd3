"""Probe: the peak of live heap bytes while a quantkit command runs (glibc only).

    python benchmarks/probes/probe_live_heap.py quantize --method gptq --out DIR

Runs ``quantkit ARGS`` in this process while a thread reads glibc's ``mallinfo2`` every 100 ms: bytes in use in
the malloc arenas plus bytes in mmapped chunks (where PyTorch's large CPU tensors live). Unlike the resident set
size, this does not count what the allocator keeps after a free, which varies from run to run (GPTQ on SmolLM2:
1.29-1.55 GB of peak RSS over four runs of the same code), so it compares two versions of the code. Sampling
every 100 ms misses shorter peaks; a faster rate holds the allocator's lock long enough to slow the run several
times over.
"""

from __future__ import annotations

import ctypes
import sys
import threading
import time


class MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                     "keepcost")
    ]  # fmt: skip


def main() -> None:
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo2
    peak = {"bytes": 0, "at": 0.0}
    t0 = time.perf_counter()

    def sample() -> None:
        while True:
            info = libc.mallinfo2()
            live = info.uordblks + info.hblkhd
            if live > peak["bytes"]:
                peak.update(bytes=live, at=time.perf_counter() - t0)
            time.sleep(0.1)

    threading.Thread(target=sample, daemon=True).start()
    from quantkit.cli.main import main as quantkit

    sys.argv = ["quantkit", *sys.argv[1:]]
    try:
        quantkit()
    except SystemExit as e:
        if e.code:
            raise
    finally:
        print(f"peak live heap: {peak['bytes'] / 2**20:.0f} MiB at {peak['at']:.0f} s", flush=True)


if __name__ == "__main__":
    main()
