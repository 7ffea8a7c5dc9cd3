"""Text sources: what each kind of source gives, and how an unreachable hub fails (fast, one line)."""

import socket

import datasets
import pytest

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
