"""``benchmarks/markdown_region.py``: a benchmark's ``--markdown`` run replaces its table regions in the page in place
(a region appended a second time under the same ID once broke ``test_docs``)."""

from __future__ import annotations

import pytest

from .bench import load_benchmark

markdown_region = load_benchmark("markdown_region")


def _region(rid: str, body: str) -> str:
    return f"<!-- table: {rid} -->\n{body}\n<!-- /table -->"


def test_a_region_already_in_the_page_is_replaced_where_it_is(tmp_path):
    page = tmp_path / "bench.md"
    page.write_text(f"# top\n\n{_region('a', 'old a')}\n\nprose about a\n\n{_region('b', 'old b')}\n")
    done = markdown_region.write_tables(page, "\n" + _region("a", "new a") + "\n")
    assert done == ["a (replaced)"]
    assert page.read_text() == f"# top\n\n{_region('a', 'new a')}\n\nprose about a\n\n{_region('b', 'old b')}\n"


def test_a_new_region_is_appended_with_its_heading(tmp_path):
    page = tmp_path / "bench.md"
    page.write_text("# top\n")
    done = markdown_region.write_tables(page, "\n## save\n\n" + _region("c", "c") + "\n")
    assert done == ["c (new)"]
    assert page.read_text() == "# top\n\n## save\n\n" + _region("c", "c") + "\n"


def test_one_run_with_a_known_and_a_new_region_replaces_one_and_appends_the_other(tmp_path):
    page = tmp_path / "bench.md"
    page.write_text(_region("a", "old") + "\nend\n")
    done = markdown_region.write_tables(page, "\n" + _region("a", "new") + "\n\n" + _region("d", "d") + "\n")
    assert done == ["a (replaced)", "d (new)"]
    assert page.read_text() == _region("a", "new") + "\nend\n\n" + _region("d", "d") + "\n"


def test_a_page_holding_an_id_twice_is_refused_unchanged(tmp_path):
    page = tmp_path / "bench.md"
    text = _region("a", "1") + "\n" + _region("a", "2") + "\n"
    page.write_text(text)
    with pytest.raises(ValueError, match="`a` is there 2 times"):
        markdown_region.write_tables(page, _region("a", "3"))
    assert page.read_text() == text
