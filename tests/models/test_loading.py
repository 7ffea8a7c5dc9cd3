"""Model resolution helpers that need no real model."""

import pytest

from quantkit.models.loading import publish_conversion


def _folder(path, files):
    path.mkdir()
    for name in files:
        (path / name).write_text("x")
    return path


def test_publish_moves_a_finished_conversion_into_place(tmp_path):
    tmp = _folder(tmp_path / ".convert-a", ["config.json", "model.safetensors"])
    target = tmp_path / "model"
    publish_conversion(tmp, target)
    assert (target / "model.safetensors").is_file() and not tmp.exists()


def test_publish_keeps_a_conversion_another_process_finished_first(tmp_path):
    """Two test workers on a fresh cache convert the GGUF at once: the second one's move finds the folder there."""
    target = _folder(tmp_path / "model", ["config.json", "theirs"])
    tmp = _folder(tmp_path / ".convert-b", ["config.json", "ours"])
    publish_conversion(tmp, target)
    assert (target / "theirs").is_file() and not (target / "ours").exists() and not tmp.exists()


def test_publish_refuses_to_hide_a_broken_target(tmp_path):
    target = _folder(tmp_path / "model", ["stray"])  # not a finished conversion: no config.json
    tmp = _folder(tmp_path / ".convert-c", ["config.json"])
    with pytest.raises(OSError):
        publish_conversion(tmp, target)
