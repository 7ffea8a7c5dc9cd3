"""The W4A16 dispatch table: its order, and the same choice as before it was a table on every product of the grid.

``dispatch_choices.txt`` holds the choices ``w4a16_linear`` made when it tried ``mma_plan``, ``rega_plan`` and
``ws_plan`` in turn and then ``config_for`` (generated from that code on the grid below, with a
``GPU`` description standing in for each device). The table must make the same choice, config and split-K factor
for every (device, bits, group, layer, M); the dtype does not enter the rules (both are 16-bit), which the last
test checks.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import triton
from quantkit.kernels._device import GPU
from quantkit.kernels.w4a16 import dispatch, mma_gemv_configs, rega, ws
from quantkit.kernels.w4a16.configs import WIDE_M1, config_for
from quantkit.kernels.w4a16.problem import Plan, Product

CHOICES = Path(__file__).with_name("dispatch_choices.txt")


def new_choice(cap, sms, version, bits, group, m, n, k, dtype=torch.float16):
    triton.__version__ = version  # the Gluon paths read it when asked
    plan = dispatch.choose(Product.dense(m, n, k, bits, group, dtype, GPU(cap, sms)))
    return plan.path, plan.config.name, plan.split


@pytest.fixture
def triton_version(monkeypatch):
    monkeypatch.setattr(triton, "__version__", triton.__version__)  # restored after the test


def test_table_order():
    assert [p.name for p in dispatch.PATHS] == ["mma_gemv", "rega", "ws", "table"]


def test_choices_match_the_dispatch_before_the_table(triton_version):
    want = CHOICES.read_text().splitlines()
    got = choice_lines(new_choice)
    diff = [f"- {a}\n+ {b}" for a, b in zip(want, got, strict=True) if a != b]
    assert not diff, "choices changed:\n" + "\n".join(diff[:10])


def test_the_first_path_with_a_plan_serves(triton_version, monkeypatch):
    triton.__version__ = "3.6.0"
    p = Product.dense(96, 8192, 8192, 4, 128, torch.float16, GPU())  # both the rega and the ws paths take it
    rega, ws, table = (path.plan(p) for path in dispatch.PATHS[1:])
    assert rega is not None and ws is not None and table is not None
    assert dispatch.choose(p) == rega
    monkeypatch.setattr(dispatch, "PATHS", (dispatch.PATHS[2], dispatch.PATHS[1], dispatch.PATHS[3]))
    assert dispatch.choose(p) == ws
    monkeypatch.setattr(dispatch, "PATHS", (dispatch.PATHS[-1],))
    assert dispatch.choose(p) == table


def test_off_cuda_and_with_another_triton_only_the_table_serves(triton_version):
    triton.__version__ = "3.9.0"
    for m in MS:
        for n, k in LAYERS:
            for gpu in (None, GPU()):
                plan = dispatch.choose(Product.dense(m, n, k, 4, 128, torch.float16, gpu))
                assert plan.path == "table" and plan.config == config_for(m, n)


def test_explicit_config_and_wide_layers_take_the_table():
    p = Product.dense(1, 14336, 4096, 4, 128, torch.float16, None)
    assert dispatch.table_plan(p).config is WIDE_M1
    assert isinstance(dispatch.table_plan(p), Plan)
    cfg = config_for(256)
    assert dispatch.table_plan(p, cfg).config is cfg and dispatch.table_plan(p, cfg).split == 1


@pytest.mark.parametrize("cap", [(9, 0), (10, 0)])
def test_bf16_chooses_as_fp16(triton_version, cap):
    for m in MS:
        for n, k in LAYERS[:6]:
            assert new_choice(cap, 132, "3.6.0", 4, 64, m, n, k, torch.bfloat16) == new_choice(
                cap, 132, "3.6.0", 4, 64, m, n, k
            )


def test_devices_cover_the_rules():
    assert {cap for cap, _, _ in DEVICES} == {(8, 0), (9, 0), (10, 0)}
    assert "ws:" in CHOICES.read_text() and "rega:" in CHOICES.read_text() and "mma_gemv:" in CHOICES.read_text()


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: mma_gemv_configs.MmaGemvConfig(num_warps=3), "num_warps"),
        (lambda: mma_gemv_configs.MmaGemvConfig(max_split=0), "max_split"),
        (lambda: rega.RegaConfig(block_n=96), "block_n"),
        (lambda: rega.RegaConfig(stages=0), "stages"),
        (lambda: ws.WSConfig(128, 128, 128, 3, 4, dq_warps=6), "dq_warps"),
        (lambda: ws.WSConfig(128, 128, 128, 0, 4), "stages"),
    ],
)
def test_path_configs_are_checked(make, match):
    with pytest.raises(ValueError, match=match):
        make()


# The grid of W4A16 products on which the dispatch table's choices are pinned (``test_dispatch.py``), and the
# choices written in one line per device and layer: ``choice_lines`` renders them, ``dispatch_choices.txt`` holds
# those the dispatch made before it became a table (``w4a16_linear``'s chain of plan functions), so any change of
# choice shows as a diff of lines.


# (capability, SMs, Triton version): Hopper with the Triton the Gluon kernels are written for, at 132 and 114 SMs;
# Ampere and Blackwell capabilities (the sm_90-only paths decline, the mma.sync gemv runs from sm_90 on)
DEVICES = (((9, 0), 132, "3.6.0"), ((9, 0), 114, "3.6.0"), ((8, 0), 108, "3.6.0"), ((10, 0), 148, "3.6.0"))
# decoder layers of Llama-2/3 (7-8B and 70B, fused qkv and gate/up included), Qwen2.5 (0.5B, 7B, 72B) and odd sizes
LAYERS = ((4096, 4096), (6144, 4096), (14336, 4096), (28672, 4096), (4096, 14336), (8192, 8192), (28672, 8192),
          (8192, 28672), (4096, 11008), (8192, 29568), (3584, 3584), (9728, 896), (4098, 4096), (256, 512))  # fmt: skip
GROUPS = (32, 64, 128, 256, 0)  # the kernel layout's contiguous group length; 0: one group per column
BITS_GROUPS = (*((4, g) for g in GROUPS), (8, 128), (8, 0))
MS = (1, 2, 3, 4, 5, 8, 9, 12, 16, 17, 24, 32, 33, 40, 48, 64, 65, 96, 128, 129, 200, 256, 257, 384, 512, 513, 1024,
      4096)  # fmt: skip


def render(path: str, name: str, split: int) -> str:
    return f"{path}:{name}" + (f"/{split}" if split > 1 else "")


def choice_lines(choose) -> list[str]:
    """One line per (device, bits, group, layer): the choices over MS, consecutive equal ones merged as
    ``m_first-m_last=path:config/split``. ``choose(cap, sms, triton, bits, group, m, n, k)`` -> (path, name, split)."""
    lines = []
    for cap, sms, version in DEVICES:
        for bits, group in BITS_GROUPS:
            for n, k in LAYERS:
                if group and k % group:
                    continue
                runs: list[list] = []
                for m in MS:
                    c = render(*choose(cap, sms, version, bits, group, m, n, k))
                    if runs and runs[-1][2] == c:
                        runs[-1][1] = m
                    else:
                        runs.append([m, m, c])
                cells = " ".join(f"{a}-{b}={c}" for a, b, c in runs)
                lines.append(f"sm{cap[0]}{cap[1]} {sms} t{version[:3]} w{bits} g{group} {n}x{k}: {cells}")
    return lines
