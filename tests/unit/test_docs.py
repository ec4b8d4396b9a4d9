"""The docs are checked like code: links resolve, every public name, option and stage is documented."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import accelerate_memsafe
from accelerate_memsafe import MemSafePlugin
from accelerate_memsafe.stages import STAGE_REGISTRY

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"] + sorted((ROOT / "examples").glob("*.md"))
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _anchors(text: str) -> set[str]:
    out = set()
    for line in text.splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            out.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return out


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_relative_links_resolve(doc):
    text = doc.read_text()
    broken = []
    for target in LINK.findall(text):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        if not dest.exists() or anchor and dest.suffix == ".md" and anchor not in _anchors(dest.read_text()):
            broken.append(target)
    assert not broken, f"{doc.relative_to(ROOT)} has broken links: {broken}"


def _all_docs_text() -> str:
    return "\n".join(p.read_text() for p in DOCS)


def test_every_public_name_is_documented():
    api = (ROOT / "docs" / "api.md").read_text()
    missing = [name for name in accelerate_memsafe.__all__ if name != "__version__" and f"`{name}" not in api]
    assert not missing, f"docs/api.md does not name: {missing}"


def test_every_option_and_its_variable_is_documented():
    conf = (ROOT / "docs" / "configuration.md").read_text()
    missing = [f.name for f in MemSafePlugin.options() if f"`{f.name}`" not in conf or MemSafePlugin.env_name(f.name) not in conf]
    assert not missing, f"docs/configuration.md does not document: {missing}"


def test_every_stage_is_documented():
    pipeline = (ROOT / "docs" / "pipeline.md").read_text()
    missing = [name for name in STAGE_REGISTRY if f"`{name}`" not in pipeline]
    assert not missing, f"docs/pipeline.md does not describe stage(s): {missing}"
