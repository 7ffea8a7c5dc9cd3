"""Draft heads (Medusa, EAGLE): training lowers the held-out loss, heads save and load (and refuse another model),
and speculative greedy output with them equals plain greedy, in mixed batches and under preemption."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from click.testing import CliRunner
from transformers import LlamaConfig, LlamaForCausalLM

from quantkit.cli.main import cli
from quantkit.errors import QuantkitError
from quantkit.runtime import LLM, SamplingParams
from quantkit.runtime.scheduler import ScheduledBatch
from quantkit.runtime.sequence import Sequence
from quantkit.runtime.speculative.config import SpeculativeConfig
from quantkit.runtime.speculative.heads import FeatureStore, read_meta
from quantkit.train_draft import RESUME_FILE, TrainDraftConfig, self_distilled_ids, split_windows, train_draft
from tests.runtime.helpers import random_prompts
from tests.tiny_models import CHAT_TEMPLATE, tiny_model_dir, tiny_tokenizer

VOCAB = 96


def tiny_model(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      initializer_range=0.2, tie_word_embeddings=False)  # fmt: skip
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)  # a peaked next-token distribution, as a trained model's
    return model


def markov_ids(n: int, seed: int = 0) -> torch.Tensor:
    """A token stream with structure: mostly x -> 7x + 3 mod VOCAB, sometimes a random token."""
    gen = torch.Generator().manual_seed(seed)
    ids = [5]
    for _ in range(n - 1):
        jump = torch.rand(1, generator=gen).item() < 0.2
        ids.append(int(torch.randint(VOCAB, (1,), generator=gen)) if jump else (7 * ids[-1] + 3) % VOCAB)
    return torch.tensor(ids)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    folder = tmp_path_factory.mktemp("target")
    model = tiny_model()
    model.save_pretrained(folder)
    return model, folder


@pytest.fixture(scope="module", params=["eagle", "medusa"])
def trained(request, target, tmp_path_factory):
    model, _ = target
    out = tmp_path_factory.mktemp(request.param)
    config = TrainDraftConfig(method=request.param, tokens=4096, seqlen=64, batch_size=2, epochs=10, lr=3e-3)
    record = train_draft(model, config, out, ids=markov_ids(6000))
    return request.param, out, record


def test_training_lowers_the_held_out_loss(trained):
    method, out, record = trained
    before, after = record["before"], record["after"]
    assert after["loss"] < 0.8 * before["loss"], (before, after)
    meta = read_meta(out)
    assert meta["method"] == method and meta["training"]["train_tokens"] == 4096
    assert not (out / RESUME_FILE).exists()


@pytest.mark.parametrize("k", [1, 4])
def test_greedy_equals_plain_greedy(trained, target, k):
    method, heads, _ = trained
    _, folder = target
    prompts = [markov_ids(n, seed=n).tolist() for n in (3, 9, 20, 33)] + random_prompts([5, 17], VOCAB, seed=1)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in LLM(str(folder), cpu_kv_blocks=64).generate(prompts, params)]
    spec = SpeculativeConfig(method=method, draft=str(heads), num_speculative_tokens=k, adaptive=False)
    llm = LLM(str(folder), cpu_kv_blocks=64, speculative=spec)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == expected
    t = llm.spec.totals
    assert t.steps > 0 and t.drafted > 0 and t.accepted > 0


def test_a_batch_drafts_what_each_sequence_drafts_alone(trained, target):
    """Sequences of a step draft together (EAGLE: one readout per depth): the counts are the sum of the runs alone."""
    method, heads, _ = trained
    spec = SpeculativeConfig(method=method, draft=str(heads), num_speculative_tokens=4, adaptive=False)
    prompts, params = (
        [markov_ids(n, seed=n).tolist() for n in (3, 9, 20, 33)],
        SamplingParams(max_tokens=24, ignore_eos=True),
    )
    counts = []
    for batch in [prompts], [[p] for p in prompts]:
        llms = [LLM(str(target[1]), cpu_kv_blocks=64, speculative=spec) for _ in batch]
        for llm, ps in zip(llms, batch, strict=True):
            llm.generate(ps, params)
        counts.append([sum(getattr(llm.spec.totals, f) for llm in llms) for f in ("steps", "drafted", "accepted")])
    assert counts[0] == counts[1] and counts[0][2] > 0


def test_greedy_under_preemption(trained, target):
    """A cache too small for all sequences at once: preempted sequences recompute, their features are rewritten."""
    method, heads, _ = trained
    _, folder = target
    prompts = [markov_ids(n, seed=n).tolist() for n in (30, 31, 32, 33, 34, 35)]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    settings = dict(cpu_kv_blocks=12, block_size=8, enable_prefix_caching=False)
    expected = [o.outputs[0].token_ids for o in LLM(str(folder), **settings).generate(prompts, params)]
    spec = SpeculativeConfig(method=method, draft=str(heads), num_speculative_tokens=3, adaptive=False)
    llm = LLM(str(folder), **settings, speculative=spec)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected
    assert llm.scheduler.num_preemptions > 0


def test_sampled_requests_run_and_stay_in_vocabulary(trained, target):
    method, heads, _ = trained
    _, folder = target
    spec = SpeculativeConfig(method=method, draft=str(heads), num_speculative_tokens=3, adaptive=False)
    llm = LLM(str(folder), cpu_kv_blocks=64, speculative=spec)
    outs = llm.generate(
        [markov_ids(12).tolist()] * 3, SamplingParams(max_tokens=30, temperature=0.8, seed=1, ignore_eos=True)
    )
    assert all(len(o.outputs[0].token_ids) == 30 for o in outs)
    assert llm.spec.totals.drafted > 0


def test_trained_heads_beat_untrained_on_acceptance(target, tmp_path):
    """EAGLE trained on the target's own greedy continuations accepts more of them than an untrained one (lr so
    small that nothing moves): the training reaches the drafts."""
    model, folder = target
    prompts = [markov_ids(8, seed=s).tolist() for s in range(20)]
    outs = LLM(str(folder), cpu_kv_blocks=64).generate(prompts, SamplingParams(max_tokens=56, ignore_eos=True))
    ids = torch.tensor([t for p, o in zip(prompts, outs, strict=True) for t in p + o.outputs[0].token_ids])
    config = TrainDraftConfig(method="eagle", tokens=1024, seqlen=64, batch_size=2, epochs=20, loss_positions=None)
    seen = [w[:8].tolist() for w in split_windows(ids, config)[0][:6]]  # prompts of training windows
    rates = []
    for name, lr in (("untrained", 1e-12), ("trained", 3e-3)):
        train_draft(model, dataclasses.replace(config, lr=lr), tmp_path / name, ids=ids)
        spec = SpeculativeConfig(method="eagle", draft=str(tmp_path / name), num_speculative_tokens=4, adaptive=False)
        llm = LLM(str(folder), cpu_kv_blocks=64, speculative=spec)
        llm.generate(seen, SamplingParams(max_tokens=56, ignore_eos=True))
        rates.append(llm.spec.totals.acceptance_rate)
    assert rates[1] > rates[0] + 0.2, rates


def test_self_distilled_text_trains_with_a_curve(target, tmp_path):
    """The target's own continuations of training passages: the greedy half is the target's greedy output from them;
    heads train on that text under bf16 autocast, recording the held-out loss before and after every epoch."""
    model, folder = target
    llm = LLM(str(folder), cpu_kv_blocks=64)
    ids = markov_ids(2000)
    own, where = self_distilled_ids(llm, ids, 600, prompt_len=8, new_tokens=24)
    assert own.numel() == where["tokens"] == 19 * 32  # ceil(600 / 32) passages of 8 + 24 tokens
    prompt = own[:8].tolist()
    assert any(ids[i : i + 8].tolist() == prompt for i in range(ids.numel() - 8))
    greedy = LLM(str(folder), cpu_kv_blocks=64).generate([prompt], SamplingParams(max_tokens=24, ignore_eos=True))
    assert own[8:32].tolist() == greedy[0].outputs[0].token_ids
    config = TrainDraftConfig(method="eagle", tokens=None, seqlen=32, batch_size=2, epochs=4, lr=3e-3,
                              precision="bf16")  # fmt: skip
    record = train_draft(model, config, tmp_path / "heads", ids=own, data_print=[where])
    curve = record["curve"]
    assert [c["epoch"] for c in curve] == [0, 1, 2, 3, 4] and record["precision"] == "bf16"
    assert record["train_tokens"] + record["val_tokens"] == own.numel() // 32 * 32
    assert curve[4]["tokens"] == 4 * record["train_tokens"] and curve[4]["loss"] < 0.9 * curve[0]["loss"], curve
    assert read_meta(tmp_path / "heads")["data"] == [where]
    with pytest.raises(QuantkitError, match="self_distill needs the model as a path"):
        train_draft(model, dataclasses.replace(config, self_distill=600), tmp_path / "again", ids=ids)
    with pytest.raises(QuantkitError, match="passages of 8 tokens; the text has 8"):
        self_distilled_ids(llm, ids[:8], 600, prompt_len=8, new_tokens=24)


def test_cli_self_distill(tmp_path):
    """train-draft --self-distill on a model with a chat template: the heads record the text and the target's own."""
    folder = tiny_model_dir(tmp_path / "model")
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    args = [
        "train-draft",
        "--model",
        str(folder),
        "--method",
        "eagle",
        "--out",
        str(tmp_path / "heads"),
        "--self-distill",
        "2000",
        "--tokens",
        "0",
        "--seqlen",
        "32",
        "--batch-size",
        "4",
        "--device",
        "cpu",
    ]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    data = read_meta(tmp_path / "heads")["data"]
    assert [d["source"].split(":")[0] for d in data][1:] == ["self-distilled"] and data[1]["tokens"] >= 2000
    result = CliRunner().invoke(cli, [*args[:6], str(tmp_path / "other"), "--self-distill", "0"])
    assert result.exit_code == 2 and "--self-distill" in result.output


def test_heads_of_another_model_are_refused(trained, tmp_path):
    method, heads, _ = trained
    other = tmp_path / "other"
    tiny_model(seed=1).save_pretrained(other)
    with pytest.raises(QuantkitError, match="made for another model: its embedding"):
        LLM(str(other), cpu_kv_blocks=64, speculative=SpeculativeConfig(method=method, draft=str(heads)))
    with pytest.raises(QuantkitError, match=r"are \w+ heads, not"):
        wrong = "medusa" if method == "eagle" else "eagle"
        LLM(str(other), cpu_kv_blocks=64, speculative=SpeculativeConfig(method=wrong, draft=str(heads)))
    with pytest.raises(QuantkitError, match="needs draft heads"):
        SpeculativeConfig(method=method)


def test_resume_continues_to_the_same_heads(target, tmp_path):
    model, _ = target
    ids = markov_ids(3000)
    config = TrainDraftConfig(
        method="medusa", num_heads=2, tokens=1024, seqlen=64, batch_size=4, epochs=3, save_every=2
    )
    whole = train_draft(model, config, tmp_path / "whole", ids=ids)

    class Stop(Exception):
        pass

    def stop_at_5(stage, done, total, note):
        if stage == "training" and done == 5:
            raise Stop

    with pytest.raises(Stop):
        train_draft(model, config, tmp_path / "cut", ids=ids, progress=stop_at_5)
    assert (tmp_path / "cut" / RESUME_FILE).exists()
    resumed = train_draft(model, config, tmp_path / "cut", ids=ids, resume=True)
    assert resumed["after"] == whole["after"]
    with pytest.raises(QuantkitError, match="already holds draft heads"):
        train_draft(model, config, tmp_path / "whole", ids=ids)
    with pytest.raises(QuantkitError, match="nothing to resume"):
        train_draft(model, config, tmp_path / "none", ids=ids, resume=True)


def test_feature_store_keeps_positions_and_gaps():
    store = FeatureStore()
    params = SamplingParams(max_tokens=4)
    a, b = Sequence(0, 0, list(range(10)), params), Sequence(1, 1, [1, 2], params)
    batch = ScheduledBatch()
    batch.add(a, 10, [])  # a prefill chunk
    b.num_computed_tokens = 1
    batch.add(b, 1, [])  # a decode: packed first
    hidden = torch.arange(11.0).unsqueeze(1).expand(11, 3)
    store.record(batch, hidden)
    assert store.seqs[1].buf[1, 0] == 0 and store.seqs[0].buf[:10, 0].tolist() == list(range(1, 11))
    a.num_computed_tokens = 10
    assert store.span(a) == (0, 10)
    store._write(0, 14, torch.zeros(2, 3))  # a gap: positions 10 .. 13 were never computed here
    a.num_computed_tokens = 16
    assert store.span(a) == (14, 16)
    store.release({1})
    assert set(store.seqs) == {1}


def test_cli_trains_on_text_and_generate_uses_the_heads(target, tmp_path):
    _, folder = target
    text = tmp_path / "text.txt"
    text.write_text("x")
    result = CliRunner().invoke(cli, ["train-draft", "--model", str(folder), "--method", "eagle", "--out",
                                      str(tmp_path / "h"), "--data", str(text)])  # fmt: skip
    assert result.exit_code == 2 and "tokenizer" in result.output  # a folder without a tokenizer cannot read text
    assert not (tmp_path / "h").exists()
    model, _ = target
    train_draft(model, TrainDraftConfig(method="medusa", tokens=512, seqlen=32), tmp_path / "h", ids=markov_ids(800))
    result = CliRunner().invoke(cli, ["generate", "--model", str(folder), "--device", "cpu", "--token-ids", "--json",
                                      "--speculative", "medusa", "--draft-model", str(tmp_path / "h"),
                                      "--max-tokens", "8", "5 38 77"])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert len(json.loads(result.output.splitlines()[0])["completions"][0]["token_ids"]) == 8
    base = ["generate", "--model", str(folder), "--device", "cpu", "--token-ids", "--json", "--max-tokens", "8"]
    plain = CliRunner().invoke(cli, [*base, "5 38 77"])
    tree = CliRunner().invoke(cli, [*base, "--speculative", "medusa", "--draft-model", str(tmp_path / "h"),
                                    "--num-tree-tokens", "6", "--tree-topk", "2", "5 38 77"])  # fmt: skip
    assert tree.exit_code == 0 and plain.exit_code == 0, tree.output
    ids = [json.loads(r.output.splitlines()[0])["completions"][0]["token_ids"] for r in (tree, plain)]
    assert ids[0] == ids[1]
    bad = CliRunner().invoke(cli, [*base, "--speculative", "ngram", "--num-tree-tokens", "6", "5 38 77"])
    assert bad.exit_code == 2 and "needs method eagle or medusa" in bad.output, bad.output


def test_an_eagle_head_of_an_moe_target_is_one_dense_layer():
    """The head copies the target's attention and norms, but a mixture-of-experts target's head has a plain MLP of
    its intermediate size: it predicts one feature, not a routed one."""
    from transformers import MixtralConfig

    from quantkit.runtime.speculative.heads import make_heads

    cfg = MixtralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                        num_experts_per_tok=2)  # fmt: skip
    head = make_heads("eagle", cfg, 1)
    head.set_rope(32, "cpu")
    assert head.layer.mlp.gate_proj.out_features == 96
    features, embeds = torch.randn(1, 5, 64), torch.randn(1, 5, 64)
    out, (k, _) = head(features, embeds, torch.arange(5))
    assert out.shape == (1, 5, 64) and k.shape[1] == 5


@pytest.mark.parametrize("steps", [1, 3])
def test_unrolled_steps_are_the_chain_the_proposer_drafts(steps):
    """``EagleHead.unrolled``'s step s at position m is what drafting computes: the layer over the target's features
    up to m - s (its KV cache), then s steps on its own predicted features, one position each."""
    from quantkit.runtime.speculative.heads import make_heads

    torch.manual_seed(0)
    head = make_heads("eagle", tiny_model().config, 1).double()
    head.set_rope(32, "cpu")
    head.cos, head.sin = head.cos.double(), head.sin.double()
    features, embeds = torch.randn(2, 12, 64, dtype=torch.double), torch.randn(2, 12, 64, dtype=torch.double)
    outs = head.unrolled(features, embeds, steps)
    assert len(outs) == steps
    torch.testing.assert_close(outs[0], head(features, embeds, torch.arange(12))[0])
    for start in (0, 4, 12 - steps):  # the chain drafted after position start
        g, kv = head(features[:, : start + 1], embeds[:, : start + 1], torch.arange(start + 1))
        g = g[:, -1:]
        for s in range(1, steps):
            m = start + s
            torch.testing.assert_close(outs[s - 1][:, m - 1 : m], g)
            g, kv = head(g, embeds[:, m : m + 1], torch.tensor([m]), kv)
        torch.testing.assert_close(outs[steps - 1][:, start + steps - 1 : start + steps], g)


def test_unrolled_training_records_each_steps_agreement(target, tmp_path):
    model, _ = target
    config = TrainDraftConfig(method="eagle", tokens=1024, seqlen=32, batch_size=2, epochs=2, lr=3e-3, unroll=3)
    record = train_draft(model, config, tmp_path / "h", ids=markov_ids(1600))
    assert len(record["after"]["top1"]) == 3 and record["after"]["loss"] < record["before"]["loss"]
    assert read_meta(tmp_path / "h")["settings"]["unroll"] == 3
    with pytest.raises(QuantkitError, match="medusa heads take unroll 1"):
        TrainDraftConfig(method="medusa", unroll=2)
    with pytest.raises(QuantkitError, match=r"unroll must be in \[1, 31\]"):
        TrainDraftConfig(method="eagle", seqlen=32, unroll=32)


# -- draft trees (num_tree_tokens) ----------------------------------------------------------------------------------


def untrained_heads(model, method: str, folder, num_heads: int = 3):
    """Heads of ``method`` as made before training (Medusa: zero blocks, repeating the target's own prediction;
    EAGLE: a random layer), saved for ``model``."""
    from quantkit.runtime.speculative.heads import base_fingerprint, make_heads, save_heads

    torch.manual_seed(0)
    base = base_fingerprint(model.config, model.get_input_embeddings().weight)
    count = num_heads if method == "medusa" else 1
    save_heads(folder, make_heads(method, model.config, count), {"method": method, "num_heads": count, "base": base})
    return folder


def assert_released(llm) -> None:
    bm = llm.block_manager
    assert bm.num_free == bm.num_blocks and bm.used_slots == 0


@pytest.mark.parametrize("shape", [(1, 3), (4, 24), (5, 63)])  # (depth k, tree tokens)
def test_tree_greedy_equals_plain_greedy(trained, target, shape, monkeypatch):
    """Trees of trained heads accept paths through later siblings, whose K/V and features move into consecutive
    positions; the output is plain greedy's in a mixed batch, and every block goes back."""
    from quantkit.runtime.speculative import tree_draft

    method, heads, _ = trained
    _, folder = target
    moved = []
    move = tree_draft.TreeDrafter._move
    monkeypatch.setattr(tree_draft.TreeDrafter, "_move", lambda self, seq, nodes: (
        moved.append(any(i + 1 != d for d, i in enumerate(nodes, 1))), move(self, seq, nodes)))  # fmt: skip
    prompts = [markov_ids(n, seed=n).tolist() for n in (3, 9, 20, 33)] + random_prompts([5, 17], VOCAB, seed=1)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in LLM(str(folder), cpu_kv_blocks=64).generate(prompts, params)]
    k, n = shape
    spec = SpeculativeConfig(method=method, draft=str(heads), num_speculative_tokens=k, adaptive=False,
                             num_tree_tokens=n, tree_topk=4)  # fmt: skip
    llm = LLM(str(folder), cpu_kv_blocks=64, speculative=spec)
    outs = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == expected
    t = llm.spec.totals
    assert t.steps > 0 and t.accepted > 0 and t.emitted == t.accepted + t.steps
    assert any(moved) or n < 4
    for c in (o.outputs[0] for o in outs):  # tau and acceptance per completion; drafted counts a tree's depth
        assert c.spec.steps > 0 and 1.0 <= c.spec.mean_emitted <= k + 1 and 0.0 <= c.spec.acceptance_rate <= 1.0
    assert_released(llm)


def test_tree_greedy_through_the_triton_prefill_kernel(trained, target):
    """The Triton attention backend (the interpreter on the CPU) takes the tree's mask words in the prefill kernel."""
    method, heads, _ = trained
    _, folder = target
    prompts = [markov_ids(n, seed=n).tolist() for n in (3, 20)] + random_prompts([9], VOCAB, seed=1)
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in LLM(str(folder), cpu_kv_blocks=64).generate(prompts, params)]
    spec = SpeculativeConfig(method=method, draft=str(heads), num_speculative_tokens=3, adaptive=False,
                             num_tree_tokens=10, tree_topk=3)  # fmt: skip
    llm = LLM(str(folder), cpu_kv_blocks=64, attention_backend="triton", speculative=spec)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected
    assert llm.spec.totals.drafted > 0


@pytest.mark.parametrize("method", ["eagle", "medusa"])
def test_tree_greedy_with_untrained_heads_sharp_attention(target, method, tmp_path):
    """Untrained heads, attention sharpened so that a wrong position or slot shows, the default accuracy table."""
    model, folder = target
    heads = untrained_heads(model, method, tmp_path / method)
    prompts = [*random_prompts([4, 11, 26], VOCAB, seed=3), markov_ids(15, seed=2).tolist()]
    params = SamplingParams(max_tokens=20, ignore_eos=True)

    def sharp(llm):
        with torch.no_grad():
            for layer in llm.model.model.layers:
                layer.self_attn.q_proj.weight.mul_(4.0)
        return llm

    expected = [o.outputs[0].token_ids for o in sharp(LLM(str(folder), cpu_kv_blocks=64)).generate(prompts, params)]
    spec = SpeculativeConfig(method=method, draft=str(heads), num_speculative_tokens=3, adaptive=False,
                             num_tree_tokens=10, tree_topk=3)  # fmt: skip
    llm = sharp(LLM(str(folder), cpu_kv_blocks=64, speculative=spec))
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected
    assert llm.spec.totals.drafted > 0
    assert_released(llm)


def test_tree_greedy_under_preemption(trained, target):
    method, heads, _ = trained
    _, folder = target
    prompts = [markov_ids(n, seed=n).tolist() for n in (30, 31, 32, 33, 34, 35)]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    settings = dict(cpu_kv_blocks=14, block_size=8, enable_prefix_caching=False)
    expected = [o.outputs[0].token_ids for o in LLM(str(folder), **settings).generate(prompts, params)]
    spec = SpeculativeConfig(method=method, draft=str(heads), num_speculative_tokens=3, adaptive=False,
                             num_tree_tokens=12, tree_topk=3)  # fmt: skip
    llm = LLM(str(folder), **settings, speculative=spec)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected
    assert llm.scheduler.num_preemptions > 0 and llm.spec.totals.accepted > 0
    assert_released(llm)


def test_tree_sampled_requests_stay_in_vocabulary(trained, target):
    method, heads, _ = trained
    _, folder = target
    spec = SpeculativeConfig(method=method, draft=str(heads), num_speculative_tokens=3, adaptive=False,
                             num_tree_tokens=12, tree_topk=3)  # fmt: skip
    llm = LLM(str(folder), cpu_kv_blocks=64, speculative=spec)
    params = SamplingParams(max_tokens=30, temperature=0.8, top_p=0.9, seed=1, ignore_eos=True)
    outs = llm.generate([markov_ids(12).tolist()] * 3, params)
    assert all(len(o.outputs[0].token_ids) == 30 and all(0 <= t < VOCAB for t in o.outputs[0].token_ids)
               for o in outs)  # fmt: skip
    assert llm.spec.totals.drafted > 0
    assert_released(llm)


@pytest.mark.parametrize("method", ["eagle", "medusa"])
def test_tree_sampling_keeps_the_target_distribution(method, tmp_path):
    """1,200 seeded requests of one prompt at temperature 1 on a 16-token vocabulary: the histograms of the second and
    third tokens with tree speculation match plain sampling (total variation within sampling noise)."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.2)  # fmt: skip
    model = LlamaForCausalLM(cfg).eval()
    model.save_pretrained(tmp_path / "m")
    heads = untrained_heads(model, method, tmp_path / method, num_heads=2)
    prompt, n = [3, 4, 5, 3, 4, 5, 3, 4], 1200

    def histograms(llm):
        params = [SamplingParams(max_tokens=3, temperature=1.0, seed=s, ignore_eos=True) for s in range(n)]
        outs = llm.generate([prompt] * n, params)
        return [torch.bincount(torch.tensor([o.outputs[0].token_ids[i] for o in outs]), minlength=16).double() / n
                for i in (1, 2)]  # fmt: skip

    settings = dict(cpu_kv_blocks=1024, block_size=4, max_num_seqs=256)
    plain = histograms(LLM(str(tmp_path / "m"), **settings))
    spec = SpeculativeConfig(method=method, draft=str(heads), num_speculative_tokens=2, adaptive=False,
                             num_tree_tokens=6, tree_topk=3)  # fmt: skip
    llm = LLM(str(tmp_path / "m"), **settings, speculative=spec)
    drafted = histograms(llm)
    t = llm.spec.totals
    assert 0 < t.accepted < t.drafted
    for a, b in zip(plain, drafted, strict=True):
        # two independent samples of 1,200: the total variation between them stays well under 0.1 when equal
        assert 0.5 * (a - b).abs().sum() < 0.1
    assert_released(llm)


def test_typical_acceptance_is_an_explicit_lossy_option_for_sampled_tree_steps(trained, target, monkeypatch):
    """acceptance_method="typical_acceptance_sampler" verifies sampled requests' trees with Medusa's rule (vLLM's
    posterior_threshold / posterior_alpha); greedy requests keep the exact rule."""
    from quantkit.runtime.speculative import tree_draft

    calls = []
    typical = tree_draft.verify_tree_typical
    monkeypatch.setattr(tree_draft, "verify_tree_typical", lambda *a: calls.append(a[3:]) or typical(*a))
    method, heads, _ = trained
    _, folder = target
    spec = SpeculativeConfig(method=method, draft=str(heads), num_speculative_tokens=3, adaptive=False,
                             num_tree_tokens=12, tree_topk=3, acceptance_method="typical_acceptance_sampler",
                             posterior_threshold=0.2, posterior_alpha=0.5)  # fmt: skip
    llm = LLM(str(folder), cpu_kv_blocks=64, speculative=spec)
    outs = llm.generate([markov_ids(12).tolist()] * 2, SamplingParams(max_tokens=20, temperature=0.8, seed=1))
    assert calls and set(calls) == {(0.2, 0.5)}
    assert all(0 <= t < VOCAB for o in outs for t in o.outputs[0].token_ids)
    calls.clear()
    llm.generate([markov_ids(12).tolist()], SamplingParams(max_tokens=10))  # greedy: the exact rule
    assert not calls
    assert_released(llm)


def test_medusa_training_records_the_accuracies_of_its_tree(trained):
    """Medusa heads' config holds each head's held-out top-k accuracies, which the runtime's sparse tree reads; a
    head's candidates are distinct tokens, so at most one is right: each row sums to at most 1."""
    from quantkit.runtime.speculative.tree_draft import default_accuracies, head_accuracies

    method, out, record = trained
    meta = read_meta(out)
    if method == "eagle":
        assert "topk_accuracy" not in record["after"]
        assert torch.equal(head_accuracies(meta, 1, 8), default_accuracies(1, 8))
        return
    table = torch.tensor(record["after"]["topk_accuracy"], dtype=torch.float64)
    assert table.shape == (meta["num_heads"], 8) and (table >= 0).all() and (table.sum(1) <= 1 + 1e-6).all()
    assert table[0, 0] == pytest.approx(record["after"]["top1"][0], abs=0.02)  # batch means against one pooled mean
    assert torch.equal(head_accuracies(meta, meta["num_heads"], 4), table[:, :4])


def test_tree_settings_are_checked(tmp_path):
    from transformers import MistralConfig, MistralForCausalLM

    with pytest.raises(QuantkitError, match="needs method eagle or medusa"):
        SpeculativeConfig(method="ngram", num_tree_tokens=8)
    with pytest.raises(QuantkitError, match="num_tree_tokens must be in"):
        SpeculativeConfig(method="medusa", draft="x", num_tree_tokens=64)
    with pytest.raises(QuantkitError, match="applies to draft trees: set num_tree_tokens"):
        SpeculativeConfig(method="medusa", draft="x", acceptance_method="typical_acceptance_sampler")
    with pytest.raises(QuantkitError, match="unknown acceptance_method 'typical'"):
        SpeculativeConfig(method="medusa", draft="x", num_tree_tokens=8, acceptance_method="typical")
    with pytest.raises(QuantkitError, match=r"posterior_alpha must be a number in \(0, 1\], got 0"):
        SpeculativeConfig(method="medusa", draft="x", num_tree_tokens=8, posterior_alpha=0)
    torch.manual_seed(0)
    cfg = MistralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, sliding_window=16)  # fmt: skip
    model = MistralForCausalLM(cfg).eval()
    model.save_pretrained(tmp_path / "m")
    heads = untrained_heads(model, "medusa", tmp_path / "h")
    spec = SpeculativeConfig(method="medusa", draft=str(heads), num_tree_tokens=8)
    with pytest.raises(QuantkitError, match="sliding-window"):
        LLM(str(tmp_path / "m"), cpu_kv_blocks=64, speculative=spec)


@pytest.mark.parametrize("adaptive", [False, True])
def test_tree_greedy_with_forks_shared_prefixes_and_adaptive_speculation(trained, target, adaptive, monkeypatch):
    """n = 2 completions share their prompt's blocks (a tree's copies go only to blocks made private by
    copy-on-write: checked at every copy), two prompts share a cached prefix, and the adaptive rule times tree steps
    like chain steps."""
    from quantkit.runtime.speculative import tree_draft

    method, heads, _ = trained
    _, folder = target
    move, llm = tree_draft.TreeDrafter._move, None

    def checked_move(self, seq, nodes):
        c, bs = seq.num_computed_tokens, llm.block_manager.block_size
        for d in range(1, len(nodes) + 1):
            assert llm.block_manager.ref_counts[seq.block_table[(c + d) // bs]] == 1
        move(self, seq, nodes)

    monkeypatch.setattr(tree_draft.TreeDrafter, "_move", checked_move)
    prefix = markov_ids(13, seed=7).tolist()
    prompts = [[*prefix, 1, 2], [*prefix, 3], markov_ids(6, seed=8).tolist()]
    params = SamplingParams(max_tokens=20, ignore_eos=True, n=2)
    settings = dict(cpu_kv_blocks=64, block_size=4)
    expected = [[c.token_ids for c in o.outputs] for o in LLM(str(folder), **settings).generate(prompts, params)]
    spec = SpeculativeConfig(method=method, draft=str(heads), num_speculative_tokens=3, num_tree_tokens=10,
                             adaptive=adaptive)  # fmt: skip
    llm = LLM(str(folder), **settings, speculative=spec)
    assert [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params)] == expected
    assert llm.spec.totals.steps > 0 and (adaptive or llm.spec.totals.accepted > 0)
    assert_released(llm)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("tree", [None, 12])
@pytest.mark.parametrize("method", ["eagle", "medusa"])
def test_heads_train_and_draft_on_cuda(target, tmp_path, method, tree):
    """On a GPU: heads train under bf16 autocast (the target's features of each batch on the device), and drafting
    with them (chains and trees through the verify graphs, which hand the heads the target's features of their real
    rows; trees under the prefill kernel's tree mask) in fp32 gives the plain greedy tokens."""
    model, folder = target
    config = TrainDraftConfig(method=method, tokens=2048, seqlen=64, batch_size=8, epochs=4, lr=3e-3)
    record = train_draft(model.cuda(), config, tmp_path / "heads", ids=markov_ids(3000), device="cuda")
    model.cpu()
    assert record["precision"] == "bf16" and record["after"]["loss"] < record["before"]["loss"]
    prompts = [markov_ids(n, seed=n).tolist() for n in (3, 9, 20, 33)] + random_prompts([5, 17], VOCAB, seed=1)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    settings = dict(device="cuda", dtype="float32", num_kv_blocks=64)
    expected = [o.outputs[0].token_ids for o in LLM(str(folder), **settings).generate(prompts, params)]
    spec = SpeculativeConfig(method=method, draft=str(tmp_path / "heads"), num_speculative_tokens=3,
                             num_tree_tokens=tree, adaptive=False)  # fmt: skip
    llm = LLM(str(folder), **settings, speculative=spec)
    graphed = []
    replay = llm.runner._run_verify_graph
    llm.runner._run_verify_graph = lambda *a: graphed.append(1) or replay(*a)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected
    assert llm.spec.totals.accepted > 0
    assert graphed  # chains and trees verify in graphs that hand the heads their features
