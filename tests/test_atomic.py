"""The one write-then-rename helper (megatron_bridge/atomic.py) that every file the package replaces
goes through: the old file or the whole new one, never a temporary file left behind."""

import os
import stat

import pytest

from megatron_bridge.atomic import replacing, write_text


def test_a_file_is_replaced_whole_with_the_umasks_mode(tmp_path):
    target = tmp_path / "metrics.jsonl"
    target.write_text("old\n")
    old_mask = os.umask(0o027)
    try:
        write_text(target, "new\n")
    finally:
        os.umask(old_mask)
    assert target.read_text() == "new\n"
    assert stat.S_IMODE(target.stat().st_mode) == 0o640
    assert os.listdir(tmp_path) == ["metrics.jsonl"]


def test_an_error_while_writing_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "layout.yaml"
    target.write_text("old\n")
    with pytest.raises(RuntimeError, match="disk full"):
        with replacing(target, durable=True) as tmp:
            with open(tmp, "w") as file:
                file.write("half")
            raise RuntimeError("disk full")
    assert target.read_text() == "old\n"
    assert os.listdir(tmp_path) == ["layout.yaml"]


def test_a_new_file_appears_only_at_the_end(tmp_path):
    target = tmp_path / "results.json"
    with replacing(target) as tmp:
        with open(tmp, "w") as file:
            file.write("{}")
        assert not target.exists() and os.path.dirname(tmp) == str(tmp_path)
    assert target.read_text() == "{}"
