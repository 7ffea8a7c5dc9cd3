"""The W4A16 dispatch table: its order, and the same choice as before it was a table on every product of the grid.

``dispatch_choices.txt`` holds the choices ``w4a16_linear`` made when it tried ``mma_plan``, ``rega_plan`` and
``ws_plan`` in turn and then ``config_for`` (generated from that code on the grid of ``dispatch_grid.py``, with a
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

from tests.kernels.w4a16.dispatch_grid import DEVICES, LAYERS, MS, choice_lines

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
