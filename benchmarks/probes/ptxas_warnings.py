"""List ptxas's performance notes for every kernel in Triton's cache (e.g. C7515: serialized wgmma).

    python benchmarks/probes/ptxas_warnings.py [CACHE_DIR]     (default: $TRITON_CACHE_DIR or ~/.triton/cache)

Runs the ptxas that ships with Triton with -v on each cached .ptx (sm_90a) and prints one line per kernel:
registers, spills and any "Potential Performance Loss" note. Run it after the tests or benchmarks that compile
the kernels of interest.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton

PTXAS = Path(triton.backends.nvidia.__file__).parent / "bin" / "ptxas"


def main() -> None:
    default = os.environ.get("TRITON_CACHE_DIR", str(Path.home() / ".triton" / "cache"))
    cache = Path(sys.argv[1] if len(sys.argv) > 1 else default)
    seen = {}
    for ptx in sorted(cache.rglob("*.ptx")):
        text = ptx.read_text()
        name = re.search(r"\.entry\s+(\w+)", text)
        arch = re.search(r"\.target\s+(\w+)", text)
        with tempfile.NamedTemporaryFile(suffix=".cubin") as out:
            target = f"-arch={arch.group(1) if arch else 'sm_90a'}"
            r = subprocess.run([PTXAS, target, "-v", str(ptx), "-o", out.name], capture_output=True, text=True)
        notes = sorted(set(re.findall(r"\((C\d+)\) Potential Performance Loss: ([^\n]*?) in the function", r.stderr)))
        regs = re.search(r"Used (\d+) registers", r.stderr)
        spill = re.search(r"(\d+) bytes spill stores", r.stderr)
        key = (name.group(1) if name else ptx.name, ptx.parent.name[:8])
        seen[key] = (regs.group(1) if regs else "?", spill.group(1) if spill else "?", notes)
    flagged = 0
    for (kernel, h), (regs, spill, notes) in sorted(seen.items()):
        flagged += bool(notes)
        note = "; ".join(f"{c}: {t[:110]}" for c, t in notes) or "-"
        print(f"{kernel:<40} {h} regs {regs:>3} spill {spill:>4}  {note}")
    print(f"{len(seen)} kernels, {flagged} with performance notes")


if __name__ == "__main__":
    main()
