"""``kernels.tuning_file.load_entries``: what a malformed table named by an option says."""

import json

import pytest

from kernels.tuning_file import load_entries


@pytest.mark.parametrize("text", ["[1, 2]", '{"entries": [1]}', '{"no": 1}', "not json"])
def test_a_named_malformed_table_is_a_clear_error(tmp_path, text):
    f = tmp_path / "t.json"
    f.write_text(text)
    with pytest.raises(ValueError, match=f"demo_tuning={f}: not a demo tuning file"):
        load_entries(str(f), tmp_path / "packaged.json", "demo_tuning", "demo")


def test_the_packaged_table_may_be_absent_and_entries_are_checked(tmp_path):
    packaged = tmp_path / "packaged.json"
    assert load_entries(str(packaged), packaged, "demo_tuning", "demo") == {}
    packaged.write_text(json.dumps({"entries": {"a": {"n": 1}, "b": None}}))
    seen = []
    got = load_entries(str(packaged), packaged, "demo_tuning", "demo", lambda key, cfg: seen.append((key, cfg)))
    assert got == {"a": {"n": 1}, "b": None} and seen == [("a", {"n": 1})]
