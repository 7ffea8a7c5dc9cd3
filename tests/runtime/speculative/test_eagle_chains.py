"""EAGLE chains drafted for the whole batch from one fixed cache (``EagleChains``, CUDA graphs on a GPU) draft what
the per-sequence eager path drafts, give plain greedy output, and hand their slots back."""

from __future__ import annotations

import pytest
import torch

from quantkit.runtime import LLM, SamplingParams
from quantkit.runtime.speculative import eagle_chains
from quantkit.runtime.speculative.config import SpeculativeConfig
from quantkit.train_draft import TrainDraftConfig, train_draft
from tests.runtime.helpers import random_prompts
from tests.runtime.speculative.test_heads import VOCAB, markov_ids, tiny_model

PARAMS = SamplingParams(max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    model = tiny_model()
    folder = tmp_path_factory.mktemp("target")
    model.save_pretrained(folder)
    heads = tmp_path_factory.mktemp("eagle")
    config = TrainDraftConfig(method="eagle", tokens=4096, seqlen=64, batch_size=2, epochs=10, lr=3e-3)
    train_draft(model, config, heads, ids=markov_ids(6000), device="cpu")
    prompts = [markov_ids(n, seed=n).tolist() for n in (3, 9, 20, 33)] + random_prompts([5, 17], VOCAB, seed=1)
    expected = [o.outputs[0].token_ids for o in LLM(str(folder), cpu_kv_blocks=64).generate(prompts, PARAMS)]
    return folder, heads, prompts, expected


def run(setup, k: int, chains: bool = True, **settings):
    folder, heads, prompts, _ = setup
    spec = SpeculativeConfig(method="eagle", draft=str(heads), num_speculative_tokens=k, adaptive=False)
    llm = LLM(str(folder), cpu_kv_blocks=64, speculative=spec, **settings)
    if not chains:
        llm.spec.proposer.chains = None
    outs = [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS)]
    t = llm.spec.totals
    return llm, outs, (t.steps, t.drafted, t.accepted)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_chains_draft_what_each_sequence_drafts_alone(setup, k):
    """The batched chain (windows padded to k + 1, prompts longer than that caught up first) accepts exactly what
    the eager per-sequence chain accepts, and the output is plain greedy's; no slot is lost."""
    _, _, _, expected = setup
    llm, outs, counts = run(setup, k)
    _, eager_outs, eager_counts = run(setup, k, chains=False)
    assert outs == eager_outs == expected
    assert counts == eager_counts and counts[2] > 0
    chains = llm.spec.proposer.chains  # finished sequences keep their slots until the next step releases them
    assert len(chains.slots) + len(chains.free) == chains.scratch and chains.free


def test_chains_through_the_triton_kernels(setup):
    """The Triton backend (the interpreter on the CPU): the window runs through the prefill kernel, the chain's steps
    through the paged decode kernel, over the chains' own cache; the drafts are the torch backend's."""
    folder, heads, prompts, expected = setup
    spec = SpeculativeConfig(method="eagle", draft=str(heads), num_speculative_tokens=3, adaptive=False)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    counts = []
    for backend in ("torch", "triton"):
        llm = LLM(str(folder), cpu_kv_blocks=64, attention_backend=backend, speculative=spec)
        outs = [o.outputs[0].token_ids for o in llm.generate(prompts[:4], params)]
        assert outs == [e[:12] for e in expected[:4]]
        counts.append((llm.spec.totals.drafted, llm.spec.totals.accepted))
    assert counts[0] == counts[1] and counts[0][1] > 0


def test_sequences_past_the_slots_draft_nothing(setup, monkeypatch):
    """With two slots, at most two sequences of the six draft in a step; the rest decode one token, and the output
    stays plain greedy's."""
    monkeypatch.setattr(eagle_chains, "MAX_SLOTS", 2)
    expected = setup[3]
    llm, outs, (_, drafted, accepted) = run(setup, 3)
    assert outs == expected
    assert llm.spec.proposer.chains.scratch == 2  # two slots and the scratch one
    _, _, (_, all_drafted, _) = run(setup, 3, chains=False)
    assert 0 < drafted < all_drafted and accepted > 0


def test_the_chains_cache_is_kept_out_of_the_kv_blocks(setup):
    """The engine counts the cache when it sizes the KV blocks (here checked on its size alone: CPU blocks are set)."""
    folder, heads, _, _ = setup
    spec = SpeculativeConfig(method="eagle", draft=str(heads), num_speculative_tokens=4)
    llm = LLM(str(folder), cpu_kv_blocks=64, speculative=spec, max_model_len=256)
    chains = llm.spec.proposer.chains
    k = chains.cache[0]
    assert llm.runner.reserved_bytes == 2 * k.numel() * k.element_size()
    assert k.shape[0] == 17 * chains.pages and chains.pages * 16 >= 256 + 2 * 4 + 2 and k.dtype == torch.float32


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("tree", [None, 24])
def test_batched_drafts_replay_cuda_graphs(setup, tree):
    """On a GPU the chains (or trees) draft in graphs, one per batch bucket met, and verify in graphs; the output
    is plain greedy's."""
    folder, heads, prompts, _ = setup
    settings = dict(device="cuda", dtype="float32", num_kv_blocks=64)
    expected = [o.outputs[0].token_ids for o in LLM(str(folder), **settings).generate(prompts, PARAMS)]
    spec = SpeculativeConfig(method="eagle", draft=str(heads), num_speculative_tokens=3, adaptive=False,
                             num_tree_tokens=tree, tree_topk=4)  # fmt: skip
    llm = LLM(str(folder), **settings, speculative=spec)
    verified = []
    replay = llm.runner._run_verify_graph
    llm.runner._run_verify_graph = lambda *a: verified.append(1) or replay(*a)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS)] == expected
    batched = llm.spec.proposer.trees if tree else llm.spec.proposer.chains
    assert batched.use_graphs and batched.graphs and verified and llm.spec.totals.accepted > 0
    alone = llm.generate(prompts[:1], PARAMS)[0].outputs[0].token_ids  # batch bucket 1 next to the larger one
    assert alone == expected[0] and 1 in batched.graphs


# -- trees (EagleTrees) ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(2, 3, 4), (4, 4, 24), (5, 8, 63)])  # (depth, topk, tree tokens)
def test_batched_trees_are_the_eager_drafters_trees(setup, shape, monkeypatch):
    """Every tree the batched drafter builds on the device is the one ``eagle_tree`` builds on the host from the same
    heads (tokens and parents, node for node), and the output is plain greedy's."""
    from quantkit.runtime.speculative import tree_draft

    folder, heads, prompts, expected = setup
    depth, topk, n = shape
    compared = []
    propose = tree_draft.TreeDrafter.propose

    def checked(self, seqs, sizes, depths):
        trees = propose(self, seqs, sizes, depths)
        for seq, size, d, tree in zip(seqs, sizes, depths, trees, strict=True):
            if size < n or d < depth:  # cut short near max_tokens: the best of the whole tree that fits
                assert tree.size <= size and int(tree.depth.max()) <= d
                continue
            eager = self._eagle(seq, size, d)
            assert (tree is None) == (eager is None)
            if tree is not None:
                assert tree.tokens.tolist() == eager.tokens.tolist() and tree.parent.tolist() == eager.parent.tolist()
                compared.append(tree.size)
        return trees

    monkeypatch.setattr(tree_draft.TreeDrafter, "propose", checked)
    spec = SpeculativeConfig(method="eagle", draft=str(heads), num_speculative_tokens=depth, adaptive=False,
                             num_tree_tokens=n, tree_topk=topk)  # fmt: skip
    llm = LLM(str(folder), cpu_kv_blocks=64, speculative=spec)
    assert llm.spec.proposer.trees is not None
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS)] == expected
    assert compared and max(compared) == min(n, topk + (depth - 1) * topk * topk)
    assert llm.spec.totals.accepted > 0


def test_trees_past_one_mask_word_draft_on_the_host(setup):
    """topk x (depth - 1) over 64 chunk rows: no batched trees (and no cache for them); trees still draft."""
    folder, heads, prompts, expected = setup
    spec = SpeculativeConfig(method="eagle", draft=str(heads), num_speculative_tokens=6, adaptive=False,
                             num_tree_tokens=20, tree_topk=16)  # fmt: skip
    llm = LLM(str(folder), cpu_kv_blocks=64, speculative=spec)
    assert llm.spec.proposer.trees is None and llm.runner.reserved_bytes == 0
    assert [o.outputs[0].token_ids for o in llm.generate(prompts[:2], PARAMS)] == expected[:2]


# -- the graph paths, with a stand-in for CUDA graphs on the CPU -----------------------------------------------------


def stand_in_graphs(monkeypatch, llm, replays: list) -> None:
    """The batched drafter's graphs as ``EagerGraph`` stand-ins (its static buffers, padded buckets and scratch rows
    run as on a GPU); ``replays`` records each replay's bucket."""
    from tests.runtime.speculative.test_engine_spec import EagerGraph

    def capture(forward, pool):
        graph = EagerGraph(forward)
        graph.pool = lambda: None
        return graph, graph.out

    monkeypatch.setattr(eagle_chains, "capture", capture)
    p = llm.spec.proposer
    batched = p.trees or p.chains
    batched.use_graphs = True
    replay = batched._replay
    batched._replay = lambda feats, host, b: (replays.append(b), replay(feats, host, b))[1]


def test_chain_graph_path_drafts_what_the_eager_chain_drafts(setup, monkeypatch):
    """Through the graph path (inputs copied into static buffers, batches padded to a bucket with scratch rows), the
    chains accept what the eager batched chain accepts."""
    _, _, _, expected = setup
    _, _, counts = run(setup, 3)
    folder, heads, prompts, _ = setup
    spec = SpeculativeConfig(method="eagle", draft=str(heads), num_speculative_tokens=3, adaptive=False)
    llm = LLM(str(folder), cpu_kv_blocks=64, speculative=spec)
    replays = []
    stand_in_graphs(monkeypatch, llm, replays)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS)] == expected
    t = llm.spec.totals
    assert (t.steps, t.drafted, t.accepted) == counts
    assert {8, 4} & set(replays) and len(llm.spec.proposer.chains.graphs) >= 2


def test_trees_through_the_graph_paths(setup, monkeypatch):
    """Batched trees through the drafter's graph path, verified through the verify graphs' layout with the tree
    mask (sequences padded to num_tree_tokens + 1 rows): plain greedy output, and some accepted path moved."""
    from quantkit.runtime.speculative import tree_draft
    from tests.runtime.speculative.test_engine_spec import EagerGraph

    folder, heads, prompts, expected = setup
    spec = SpeculativeConfig(method="eagle", draft=str(heads), num_speculative_tokens=3, adaptive=False,
                             num_tree_tokens=12, tree_topk=4)  # fmt: skip
    llm = LLM(str(folder), cpu_kv_blocks=64, speculative=spec)
    drafts = []
    stand_in_graphs(monkeypatch, llm, drafts)
    runner, verified = llm.runner, []
    runner.alloc_verify_static(spec.verify_width, 8, trees=True)
    for b in (1, 2, 4, 8):
        graph = EagerGraph(runner.static_verify_forward(b, spec.verify_width))
        graph.replay = lambda g=graph, b=b: (verified.append(b), EagerGraph.replay(g))
        runner.verify_graphs[b] = (graph, graph.out)
    moved = []
    move = tree_draft.TreeDrafter._move
    monkeypatch.setattr(tree_draft.TreeDrafter, "_move", lambda self, seq, nodes: (
        moved.append(any(i + 1 != d for d, i in enumerate(nodes, 1))), move(self, seq, nodes)))  # fmt: skip
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS)] == expected
    assert drafts and len(verified) > 5 and any(moved) and llm.spec.totals.accepted > 0


# -- a draft vocabulary (draft_vocab_size) ---------------------------------------------------------------------------


@pytest.mark.parametrize("tree", [None, 12])
def test_a_draft_vocabulary_drafts_its_tokens_only(setup, tree, monkeypatch):
    """With the 24 most frequent tokens of the heads' training text, chains and trees draft those tokens only and
    read out those rows only; greedy output stays plain greedy's; the whole vocabulary drafts as without one."""
    from quantkit.runtime.speculative import decoder, tree_draft
    from quantkit.runtime.speculative.draft_vocab import draft_vocab

    folder, heads, prompts, expected = setup
    ids = set(draft_vocab(heads, 24, VOCAB).tolist())
    seen = []
    read = decoder.SpeculativeDecoder.drafts_read
    monkeypatch.setattr(decoder.SpeculativeDecoder, "drafts_read", lambda self, seqs: (
        seen.extend(self.on_device[0].flatten().tolist() if self.on_device else []), read(self, seqs))[1])  # fmt: skip
    propose = tree_draft.TreeDrafter.propose
    monkeypatch.setattr(tree_draft.TreeDrafter, "propose", lambda self, *a: [
        seen.extend(t.tokens.tolist()) or t for t in propose(self, *a)])  # fmt: skip
    counts = {}
    for size in (24, VOCAB, None):
        seen.clear()
        spec = SpeculativeConfig(method="eagle", draft=str(heads), num_speculative_tokens=3, adaptive=False,
                                 num_tree_tokens=tree, tree_topk=4, draft_vocab_size=size)  # fmt: skip
        llm = LLM(str(folder), cpu_kv_blocks=64, speculative=spec)
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS)] == expected
        t = llm.spec.totals
        counts[size] = (t.drafted, t.accepted)
        if size == 24:
            assert seen and set(seen) <= ids and llm.spec.proposer.vocab.weight.shape == (24, 64)
        else:
            assert llm.spec.proposer.vocab is None
    assert counts[VOCAB] == counts[None] and counts[24][1] > 0


def test_draft_vocabulary_settings_are_checked(setup, tmp_path):
    from quantkit.errors import QuantkitError
    from quantkit.runtime.speculative.draft_vocab import COUNTS_FILE

    folder, heads, _, _ = setup
    assert (heads / COUNTS_FILE).is_file()  # train_draft writes the token counts
    with pytest.raises(QuantkitError, match=r"draft_vocab_size .* needs method eagle"):
        SpeculativeConfig(method="ngram", draft_vocab_size=1000)
    with pytest.raises(QuantkitError, match="draft_vocab_size must be"):
        SpeculativeConfig(method="eagle", draft=str(heads), draft_vocab_size=0)
    import shutil

    bare = tmp_path / "bare"
    shutil.copytree(heads, bare)
    (bare / COUNTS_FILE).unlink()
    spec = SpeculativeConfig(method="eagle", draft=str(bare), draft_vocab_size=16)
    with pytest.raises(QuantkitError, match="needs the token counts"):
        LLM(str(folder), cpu_kv_blocks=64, speculative=spec)


def test_cli_draft_vocab_size(setup):
    """``generate --draft-vocab-size`` drafts from the draft vocabulary (plain greedy's tokens); with another method
    it is refused in one line."""
    import json

    from click.testing import CliRunner

    from quantkit.cli.main import cli

    folder, heads, _, _ = setup
    base = ["generate", "--model", str(folder), "--device", "cpu", "--token-ids", "--json", "--max-tokens", "8"]
    plain = CliRunner().invoke(cli, [*base, "5 38 77"])
    eagle = CliRunner().invoke(cli, [*base, "--speculative", "eagle", "--draft-model", str(heads),
                                     "--draft-vocab-size", "32", "5 38 77"])  # fmt: skip
    assert eagle.exit_code == 0 and plain.exit_code == 0, eagle.output
    ids = [json.loads(r.output.splitlines()[0])["completions"][0]["token_ids"] for r in (eagle, plain)]
    assert ids[0] == ids[1]
    bad = CliRunner().invoke(cli, [*base, "--speculative", "ngram", "--draft-vocab-size", "32", "5 38 77"])
    assert bad.exit_code == 2 and "needs method eagle" in bad.output and "Traceback" not in bad.output, bad.output
