"""The W8A8 dispatch table: its order, and the same choice as before it was a table on every product of the grid.

``dispatch_choices.txt`` holds the choices ``w8a8_matmul`` made when it asked ``ws_offered`` and
``ws_unsupported_reason``, then ``pick_config`` and the TMA / persistent fall-backs (generated from that code on the
grid below, with a ``GPU`` description standing in for each device). The table must make the same
choice, config and operand fetch mode for every (device, format, options, output dtype, layer, M).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import triton
from quantkit.kernels._device import GPU
from quantkit.kernels.w8a8 import dispatch
from quantkit.kernels.w8a8.configs import TileConfig, config_for
from quantkit.kernels.w8a8.problem import Product

CHOICES = Path(__file__).with_name("dispatch_choices.txt")


@pytest.fixture(autouse=True)
def triton_36(monkeypatch):
    monkeypatch.setattr(triton, "__version__", "3.6.0")  # the Gluon kernel's version: the ws path may serve


def new_choice(cap, sms, smem, fmt, fast, pdl, out_dtype, m, n, k):
    plan = dispatch.choose(Product.dense(m, n, k, fmt, out_dtype, GPU(cap, sms, smem), fast, pdl))
    return plan.path, plan.config.name if plan.path == "tiles" else plan.config, plan.fetch


def test_table_order():
    assert [p.name for p in dispatch.PATHS] == ["ws", "tiles"]


def test_choices_match_the_dispatch_before_the_table():
    want = CHOICES.read_text().splitlines()
    got = choice_lines(new_choice)
    diff = [f"- {a}\n+ {b}" for a, b in zip(want, got, strict=True) if a != b]
    assert not diff, "choices changed:\n" + "\n".join(diff[:10])
    assert "ws:" in CHOICES.read_text()


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_bf16_output_chooses_as_fp16(fmt):
    for m in MS:
        for n, k in LAYERS:
            a, b = (
                new_choice((9, 0), 132, 232448, fmt, False, False, dt, m, n, k)
                for dt in (torch.bfloat16, torch.float16)
            )
            assert a == b


def test_off_cuda_the_tiles_serve_with_their_own_fetch_mode():
    for m in MS:
        plan = dispatch.choose(Product.dense(m, 4096, 4096, "fp8", torch.float16, None))
        cfg = config_for(m, "fp8", n=4096, sms=4)
        assert plan.path == "tiles" and plan.config == cfg and plan.fetch == cfg.use_tma


def test_an_explicit_config_takes_the_tiles_and_unfit_operands_use_pointer_loads():
    cfg = config_for(4096, "int8")
    p = Product.dense(4096, 4096, 4104, "int8", torch.float16, GPU())
    assert dispatch.tiles_plan(p, cfg).fetch == 0  # K % 16 != 0: no TMA descriptors
    big = Product.dense(4096, 4096, 4096, "fp8", torch.float32, GPU())
    assert dispatch.choose(big).path == "ws" and dispatch.tiles_plan(big).path == "tiles"


def test_pdl_rule():
    assert not dispatch.pdl_rule(16, None)
    assert not dispatch.pdl_rule(16, GPU((8, 0), 108))
    assert dispatch.pdl_rule(64, GPU()) and dispatch.pdl_rule(1, GPU((10, 0), 148))
    assert not dispatch.pdl_rule(65, GPU())


def test_tile_configs_are_checked():
    with pytest.raises(ValueError, match="config keys"):
        TileConfig.from_dict({"BLOCK_M": 16})
    with pytest.raises(ValueError, match="USE_TMA must be one of"):
        TileConfig(16, 32, 256, 1, 5, 4, 6)
    with pytest.raises(ValueError, match="BLOCK_N must be a power of two"):
        TileConfig(16, 48, 256, 1, 0, 4, 6)
    cfg = config_for(1, "int8")
    assert TileConfig.from_dict(cfg.to_dict()) == cfg


# The grid of W8A8 products on which the dispatch table's choices are pinned (``test_dispatch.py``), and the
# choices written in one line per device, format and options: ``choice_lines`` renders them, ``dispatch_choices.txt``
# holds those ``w8a8_matmul`` made before its dispatch became a table, so any change of choice shows as a diff.


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
