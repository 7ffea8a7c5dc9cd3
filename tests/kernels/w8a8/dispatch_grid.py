"""The grid of W8A8 products on which the dispatch table's choices are pinned (``test_dispatch.py``), and the
choices written in one line per device, format and options: ``choice_lines`` renders them, ``dispatch_choices.txt``
holds those ``w8a8_matmul`` made before its dispatch became a table, so any change of choice shows as a diff."""

from __future__ import annotations

import torch

# (capability, SMs, shared memory per block): H200 / H100 SXM, H100 PCIe, A100, B200
DEVICES = (((9, 0), 132, 232448), ((9, 0), 114, 232448), ((8, 0), 108, 166912), ((10, 0), 148, 232448))
LAYERS = ((4096, 4096), (14336, 4096), (4096, 14336), (28672, 8192), (4096, 4104), (1024, 512))
MS = (1, 2, 16, 17, 32, 33, 64, 65, 128, 256, 257, 512, 1024, 4096, 16384)
OUT_DTYPES = (torch.float16, torch.float32)  # bf16 takes fp16's choices (2 bytes too)
OPTIONS = ((False, False), (True, False), (False, True))  # (fp8_fast_accum, pdl)


def render(path: str, name: str, fetch: int) -> str:
    return f"{path}:{name}" + (f"/{fetch}" if path == "tiles" else "")


def choice_lines(choose) -> list[str]:
    """One line per (device, format, options, out dtype, layer): the choices over MS, consecutive equal ones merged.
    ``choose(cap, sms, smem, fmt, fast, pdl, out_dtype, m, n, k)`` -> (path, config name, fetch mode)."""
    lines = []
    for cap, sms, smem in DEVICES:
        for fmt in ("int8", "fp8"):
            for fast, pdl in OPTIONS:
                for out_dtype in OUT_DTYPES:
                    for n, k in LAYERS:
                        runs: list[list] = []
                        for m in MS:
                            c = render(*choose(cap, sms, smem, fmt, fast, pdl, out_dtype, m, n, k))
                            if runs and runs[-1][2] == c:
                                runs[-1][1] = m
                            else:
                                runs.append([m, m, c])
                        cells = " ".join(f"{a}-{b}={c}" for a, b, c in runs)
                        head = f"sm{cap[0]}{cap[1]} {sms} {fmt} fast={int(fast)} pdl={int(pdl)} {str(out_dtype)[6:]}"
                        lines.append(f"{head} {n}x{k}: {cells}")
    return lines
