"""The Gluon kernels' PTX unpacking, run on the CPU by a small interpreter of the few instructions it uses.

``ws_kernel.ptx_pairs`` (also the register-A kernel's unpacking) turns one packed GPTQ word and a zero pair into
four registers, each holding codes (j, j + 4) minus the zero as two 16-bit floats. Gluon has no interpreter mode, so
the GPU tests run the kernels; here the PTX text itself is executed on random words against the codes' definition.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from quantkit.kernels.w4a16 import rega_kernel, ws_kernel

DTYPES = {"f16": torch.float16, "bf16": torch.bfloat16}
MAGIC = {"f16": 0x64006400, "bf16": 0x43004300}  # 1024 + code (fp16), 128 + code (bf16) in each half


def run_ptx(text: str, regs: dict[str, int], kind: str) -> dict[str, int]:
    """Execute lop3 (0xea: (a & b) | c), shr.u32 and sub.rn.<kind>x2 on 32-bit registers."""

    def val(tok: str) -> int:
        tok = tok.strip().rstrip(";")
        return int(tok, 16) if tok.startswith("0x") else regs[tok] if tok in regs else int(tok)

    def halves(v: int) -> torch.Tensor:
        return torch.tensor([v & 0xFFFF, v >> 16], dtype=torch.int32).to(torch.int16).view(DTYPES[kind])

    for line in text.splitlines():
        op, args = line.split(" ", 1)
        dst, *src = (a.strip() for a in args.rstrip(";").split(","))
        if op == "lop3.b32":
            assert src[3] == "0xea"
            regs[dst] = (val(src[0]) & val(src[1])) | val(src[2])
        elif op == "shr.u32":
            regs[dst] = val(src[0]) >> val(src[1])
        elif op == f"sub.rn.{kind}x2":
            d = (halves(val(src[0])) - halves(val(src[1]))).view(torch.int16).to(torch.int32) & 0xFFFF
            regs[dst] = int(d[0]) | int(d[1]) << 16
        else:
            raise AssertionError(f"unexpected instruction {op}")
    return regs


@pytest.mark.parametrize("kind", ["f16", "bf16"])
def test_pairs_are_codes_minus_the_zero(kind):
    g = torch.Generator().manual_seed(0)
    text = ws_kernel.ptx_pairs(MAGIC[kind], kind)
    for _ in range(50):
        codes = torch.randint(0, 16, (8,), generator=g).tolist()
        z = int(torch.randint(0, 16, (1,), generator=g))
        word = sum(c << (4 * j) for j, c in enumerate(codes))
        zero_half = (MAGIC[kind] & 0xFFFF) | z  # magic + z as one 16-bit float
        regs = run_ptx(text, {"$4": word, "$5": zero_half | zero_half << 16}, kind)
        for j in range(4):
            pair = torch.tensor([regs[f"t{j}"] & 0xFFFF, regs[f"t{j}"] >> 16], dtype=torch.int32)
            got = pair.to(torch.int16).view(DTYPES[kind]).float().tolist()
            assert got == [codes[j] - z, codes[j + 4] - z]


def test_gluon_modules_import_without_a_gpu():
    """The dispatch imports the launch sides everywhere; the kernel modules themselves must import too."""
    for name in ("mma_gemv", "rega_kernel", "ws_kernel"):
        assert importlib.import_module(f"quantkit.kernels.w4a16.{name}")
    assert rega_kernel.ptx_pairs is ws_kernel.ptx_pairs  # one unpacking for both kernels
