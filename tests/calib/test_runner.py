"""The layer-by-layer runner's statistics: early-stopped, input-sharing collection equals a plain full pass."""

import pytest
import torch

from quantkit.calib.runner import LayerContext, capture_layer_inputs
from quantkit.calib.stats import StatsCollector
from quantkit.models.arch import arch_for
from quantkit.pipeline import prepare_model
from tests.tiny_models import CONFIGS, tiny_model


class UnsharedCollector(StatsCollector):
    def _shares_input(self, name, x):
        return False


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_collect_matches_independent_full_pass(arch):
    model = tiny_model(arch)
    prepare_model(model)
    spec = arch_for(model)
    batches = list(torch.randint(3, 320, (6, 24), generator=torch.Generator().manual_seed(0)).split(2))
    hidden, kwargs = capture_layer_inputs(model, spec, batches, torch.device("cpu"))
    layer = model.get_submodule(spec.layers)[0]
    ctx = LayerContext(0, f"{spec.layers}.0", layer, spec, hidden, kwargs[0], torch.device("cpu"))
    for group in ctx.sequential_groups():
        modules = dict(group)
        fast = ctx.collect(modules)
        with UnsharedCollector(modules) as reference:
            ctx.forward()
        for name in modules:
            if name not in reference.stats:  # an expert that received no token
                assert fast[name].n_tokens == 0
                continue
            ref = reference.stats[name]
            assert fast[name].n_tokens == ref.n_tokens == sum(b.numel() for b in batches) or "experts" in name
            torch.testing.assert_close(fast[name].xtx, ref.xtx)
            torch.testing.assert_close(fast[name].absmax, ref.absmax)
            torch.testing.assert_close(fast[name].abssum, ref.abssum)


def test_modules_fed_by_one_tensor_share_their_statistics():
    model = tiny_model("llama")
    spec = arch_for(model)
    batches = [torch.randint(3, 320, (2, 16))]
    hidden, kwargs = capture_layer_inputs(model, spec, batches, torch.device("cpu"))
    ctx = LayerContext(0, "model.layers.0", model.model.layers[0], spec, hidden, kwargs[0], torch.device("cpu"))
    qkv = dict(ctx.sequential_groups()[0])
    stats = ctx.collect(qkv)
    q, k, v = (stats[f"self_attn.{p}_proj"] for p in "qkv")
    assert q is k is v  # one X^T X for the three projections of the same normed input


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the 16-bit tensor-core Hessian path is CUDA-only")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_hessian_of_16bit_inputs_equals_fp32_gemm(dtype):
    """X^T X from 16-bit activations on tensor cores accumulates in fp32: its error stays within the worst-case
    bound of an fp32 sum of n products, n eps32 (|X|^T |X|) (Higham); a 16-bit accumulation would not."""
    lin = torch.nn.Linear(512, 8, device="cuda", dtype=dtype)
    xs = [torch.randn(3, 700, 512, device="cuda", dtype=dtype) for _ in range(3)]
    with StatsCollector({"lin": lin}) as col:
        for x in xs:
            lin(x)
    x32 = torch.cat([x.reshape(-1, 512).float() for x in xs])
    expect = x32.t().double() @ x32.double()
    got = col.stats["lin"].xtx.double()
    a = x32.abs().double()
    bound = x32.shape[0] * torch.finfo(torch.float32).eps * (a.t() @ a)
    assert bool(((got - expect).abs() <= bound).all())


class TwoBlocks(torch.nn.Module):
    """A layer whose ``once`` child runs once per call and whose ``twice`` child runs twice; ``once``'s output is
    changed in place by its caller."""

    def __init__(self):
        super().__init__()
        self.once = torch.nn.Linear(4, 4)
        self.twice = torch.nn.Linear(4, 4)

    def forward(self, h):
        a = self.once(h)
        a.mul_(2)  # a caller that reuses what it got
        return self.twice(self.twice(a))


def two_blocks_context():
    """A TwoBlocks layer on three batches, its context and its plain outputs."""
    torch.manual_seed(0)
    layer = TwoBlocks()
    hidden = [torch.randn(2, 3, 4) for _ in range(3)]
    ctx = LayerContext(0, "layer", layer, None, hidden, [{} for _ in hidden], torch.device("cpu"))
    return layer, hidden, ctx, ctx.forward()


def test_replay_runs_a_settled_child_once_per_batch():
    layer, _, ctx, expected = two_blocks_context()
    counts = {"once": 0, "twice": 0}

    def counted(name, run):
        def forward(*args):
            counts[name] += 1
            return run(*args)

        return forward

    for name in counts:  # an instance's own forward, as accelerate's offload hooks set
        getattr(layer, name).forward = counted(name, getattr(layer, name).forward)
    ctx.replay("once")
    ctx.replay("twice")
    for _ in range(3):  # the outputs stay exact though the caller scales what it gets in place
        assert all(torch.equal(a, b) for a, b in zip(ctx.forward(), expected, strict=True))
    ctx.stop_replaying()
    assert counts == {"once": 3, "twice": 18}  # once: one run per batch; twice: never replayed
    ctx.forward()  # the counting forwards are back, the replays gone
    assert counts == {"once": 6, "twice": 24}


def test_last_forward_puts_outputs_in_the_inputs_place():
    layer, hidden, ctx, expected = two_blocks_context()
    runs = []
    own = layer.once.forward
    layer.once.forward = lambda *a: runs.append(1) or own(*a)
    ctx.replay("once")
    ctx.forward()  # records "once" (3 runs)
    out = ctx.forward(last=True)  # hands the records over: "once" runs no more, the caller may scale them
    ctx.stop_replaying()
    assert out is hidden and len(runs) == 3
    assert all(torch.equal(a, b) for a, b in zip(out, expected, strict=True))


@pytest.mark.parametrize(
    "experts, statistics",
    [({}, "none"), ({"statistics": "all"}, "all"), ({"min_tokens": 1}, "all"), ({"min_tokens": 1, "below_min": "rtn"},
                                                                                "none")],
    ids=["routed", "all", "min-all", "min-rtn"],
)  # fmt: skip
def test_an_expert_without_tokens_is_reported_and_gets_the_chosen_rule(experts, statistics, tmp_path):
    """DeepSeek-V3's correction bias steers every token away from the group of experts 2 and 3: they receive no
    calibration token. Their count is reported; with statistics from every token GPTQ fits them on all tokens, else
    they are quantized by round-to-nearest; the routed experts keep their own statistics."""
    import quantkit
    from quantkit.checkpoint.inspect import inspect_checkpoint
    from quantkit.recipe import Recipe

    model = tiny_model("deepseek_v3")
    with torch.no_grad():
        model.model.layers[1].mlp.gate.e_score_correction_bias.copy_(torch.tensor([0.0, 0.0, -100.0, -100.0]))
    calib = torch.randint(3, 320, (2, 16), generator=torch.Generator().manual_seed(0))
    recipe = Recipe.from_dict({"scheme": {"bits": 4, "group_size": 16}, "stages": [{"method": "gptq"}],
                               "experts": experts})  # fmt: skip
    layers = quantkit.quantize(model, recipe, calib=calib).layers
    prefix = "model.layers.1.mlp.experts"
    for e in range(4):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            row = layers[f"{prefix}.{e}.{proj}"]
            want = 32 if e < 2 else 0  # every token goes to experts 0 and 1 (top-2 of the one chosen group)
            assert row["expert_tokens"] == want
            if e >= 2:
                assert row["expert_statistics"] == statistics
                assert row["tokens"] == (32 if statistics == "all" else 0)
            else:
                assert row["expert_statistics"] == ("all" if experts.get("statistics") == "all" else "routed")
                assert row["tokens"] == 32
    assert "expert_tokens" not in layers["model.layers.1.mlp.shared_experts.up_proj"]
    out = quantkit.save_quantized(model, tmp_path / "q")
    rows = inspect_checkpoint(out)["experts"]
    assert [(r["expert"], r["tokens"], r["statistics"]) for r in rows][2:] == [(2, 0, statistics), (3, 0, statistics)]
    from click.testing import CliRunner

    from quantkit.cli.main import cli

    r = CliRunner().invoke(cli, ["inspect", str(out)])
    assert r.exit_code == 0 and f"{prefix}.3: 0 calibration tokens routed, statistics: {statistics}" in r.stdout
