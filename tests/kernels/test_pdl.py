"""quantkit.kernels.pdl: when kernels are launched with programmatic dependent launch."""

import torch
from quantkit.kernels import pdl


def test_chain_is_scoped_and_restores_the_previous_state():
    x = torch.empty(1)
    assert not pdl._chain
    with pdl.chain():
        assert pdl._chain
        with pdl.chain(False):
            assert not pdl._chain
        assert pdl._chain
    assert not pdl._chain
    try:
        with pdl.chain():
            raise KeyError
    except KeyError:
        pass
    assert not pdl._chain and not pdl.active(x)


def test_never_on_cpu_or_in_the_interpreter(monkeypatch):
    x = torch.empty(1)
    with pdl.chain():
        assert not pdl.active(x)  # a CPU tensor
    assert not pdl.supported(torch.device("cpu"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not pdl.supported(torch.device("cuda", 0))  # decided before asking the device anything


def test_launch_options():
    assert pdl.launch_options(True) == {"launch_pdl": True}
    assert pdl.launch_options(False) == {}
