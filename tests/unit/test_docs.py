"""The docs are checked like code: links resolve; every public name, option and stage is documented; documented
defaults, formulas and formats are the code's; every benchmark figure quoted in the README and docs is its table's
cell; every guarantee names a test that exists and the known gaps are listed; every error class has its
troubleshooting entry, with messages the code writes."""

from __future__ import annotations

import ast
import functools
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest

import accelerate_memsafe
from accelerate_memsafe import MemSafePlugin
from accelerate_memsafe.sizes import parse_size
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


def _option_tables(doc: Path) -> list[dict[str, str]]:
    """Rows (header -> cell) of every table in `doc` with an `option` and a `default` column."""
    rows, lines = [], doc.read_text().splitlines()
    for i, line in enumerate(lines):
        if line.startswith("|") and i + 1 < len(lines) and lines[i + 1].startswith("|---"):
            header = _cells(line)
            if "option" in header and "default" in header:
                j = i + 2
                while j < len(lines) and lines[j].startswith("|"):
                    rows.append(dict(zip(header, _cells(lines[j]))))
                    j += 1
    return rows


def _documented_default(cell: str):
    """The value a `default` cell states: its first code literal, else a size ("64 MiB"), "off"/"on", a number."""
    literal = re.search(r"`([^`]+)`", cell)
    text = literal.group(1) if literal else cell.strip()
    if text in ("off", "on"):
        return text == "on"
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return parse_size(text) if literal is None else text


@pytest.mark.parametrize("doc", ["configuration.md", "prepare.md"])
def test_documented_defaults_are_the_code_defaults(doc):
    fields = {f.name: f for f in MemSafePlugin.options()}
    rows = _option_tables(ROOT / "docs" / doc)
    assert rows, f"docs/{doc} has no option table"
    wrong = []
    for row in rows:
        name = row["option"].strip("`")
        if name not in fields:
            wrong.append(f"`{name}` is not an option of MemSafePlugin")
            continue
        stated, actual = _documented_default(row["default"]), fields[name].default
        if stated != actual or (actual is not None and type(stated) is not type(actual) and
                                not (isinstance(actual, float) and type(stated) is int)):
            wrong.append(f"`{name}`: documented default {row['default']!r} ({stated!r}), the code's {actual!r}")
    assert not wrong, f"docs/{doc}: " + "; ".join(wrong)


def _bucket_formula(text: str, where: str) -> str:
    found = re.search(r"[Ee]ach bucket is ``?([^`]+)``? bytes", " ".join(text.split()))
    assert found, f"{where} does not say how big a bucket is (`Each bucket is `<formula>` bytes`)"
    return found.group(1)


def test_the_documented_bucket_size_is_what_the_distribution_uses():
    """`bucket_bytes` is documented as the bound on rank 0's copies in flight, with each bucket
    `bucket_bytes // (prefetch_buckets + 2)` bytes: the formula is evaluated against the function the
    distribution takes its bucket size from, and the documented default size against the defaults."""
    from accelerate_memsafe.distributed.plan import bucket_budget
    from accelerate_memsafe.docs_index import option_docs

    sources = {
        "the `bucket_bytes` docstring": option_docs()["bucket_bytes"],
        "docs/configuration.md": (ROOT / "docs" / "configuration.md").read_text(),
        "docs/prepare.md": (ROOT / "docs" / "prepare.md").read_text(),
    }
    for where, text in sources.items():
        formula = _bucket_formula(text, where)
        for bucket_bytes in (2**20, 32 * 2**20, 64 * 2**20, 10**9 + 7):
            for prefetch in (1, 2, 5):
                for world in (2, 8, 512):
                    code = bucket_budget(bucket_bytes, prefetch, world)
                    doc = eval(formula, {}, {"bucket_bytes": bucket_bytes, "prefetch_buckets": prefetch})
                    assert code == doc, f"{where}: {formula} = {doc}, the distribution uses {code} " \
                                        f"(bucket_bytes={bucket_bytes}, prefetch_buckets={prefetch}, {world} ranks)"
                    # what is alive on rank 0 (prefetch + 1 buckets and one bucket-sized temporary) fits bucket_bytes
                    assert (prefetch + 2) * code <= bucket_bytes
        default = re.search(r"\((\d+ MiB) (?:by default|with the defaults)", " ".join(text.split()))
        if default:
            assert parse_size(default.group(1)) == bucket_budget(MemSafePlugin().bucket_bytes,
                                                                 MemSafePlugin().prefetch_buckets, 2), where


def test_the_distribution_reports_the_documented_bucket_size():
    """What `rank0_distribute` reports as its `bucket_budget` (and plans with) is the documented formula, on a
    1-rank gloo group in this process."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    from accelerate_memsafe.distributed.collectives import Collectives
    from accelerate_memsafe.distributed.meta import move_to_meta, weights_metadata
    from accelerate_memsafe.distributed.scatter import distribute_from_rank0
    from accelerate_memsafe.distributed.source import Rank0Source
    from accelerate_memsafe.docs_index import option_docs
    from tests.spawn import free_port

    formula = _bucket_formula(option_docs()["bucket_bytes"], "the `bucket_bytes` docstring")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    for bucket_bytes, prefetch in ((4096, 1), (10_000, 2), (1 << 20, 5)):
        model = nn.Sequential(nn.Linear(64, 32), nn.Linear(32, 8))
        originals = move_to_meta(model, [], weights_metadata(model), keep=True)
        fully_shard(model)
        stats = distribute_from_rank0(model, Rank0Source(originals), coll=Collectives("test", timeout_s=30),
                                      bucket_bytes=bucket_bytes, prefetch_buckets=prefetch, device=torch.device("cpu"))
        documented = eval(formula, {}, {"bucket_bytes": bucket_bytes, "prefetch_buckets": prefetch})
        assert stats.bucket_budget == documented, (bucket_bytes, prefetch, stats.bucket_budget, documented)


def test_documented_choices_and_formats_are_accepted():
    """Every `load_source` the code accepts is described in the docstring and in configuration.md; the size and
    boolean formats configuration.md gives parse as it says."""
    from accelerate_memsafe.distributed.local_read import LOAD_SOURCES
    from accelerate_memsafe.docs_index import option_docs

    conf = (ROOT / "docs" / "configuration.md").read_text()
    row = next(r for r in _option_tables(ROOT / "docs" / "configuration.md") if r["option"] == "`load_source`")
    for where, text in (("docstring", option_docs()["load_source"]), ("configuration.md", row["what it does"])):
        missing = [c for c in LOAD_SOURCES if f'"{c}"' not in text]
        assert not missing, f"the `load_source` {where} does not describe {missing}"
    sizes = re.findall(r'`"(\w+)"` = (\d+)·(\d+)\^(\d+)', conf)
    assert len(sizes) >= 2, "configuration.md no longer gives size examples"
    for text, n, base, exp in sizes:
        assert parse_size(text) == int(n) * int(base) ** int(exp), text
    pairs = re.search(r"Booleans in variables: (.*)\.", conf).group(1)
    for yes, no in re.findall(r"`(\w+)/(\w+)`", pairs):
        for raw, value in ((yes, True), (no, False)):
            got = MemSafePlugin.from_env({MemSafePlugin.env_name("optimizer_offload"): raw}).optimizer_offload
            assert got is value, f"ACCELERATE_MEMSAFE_OPTIMIZER_OFFLOAD={raw} gives {got}"


GUARANTEES = ROOT / "docs" / "guarantees.md"
NOT_PROMISES = ("What is not promised", "Known gaps", "The kill harness")  # the last describes a test itself


@functools.lru_cache(maxsize=1)
def _test_functions() -> frozenset[str]:
    names = set()
    for path in (ROOT / "tests").rglob("*.py"):
        names.update(re.findall(r"^(?:async )?def (test_\w+)\(", path.read_text(), flags=re.M))
    return frozenset(names)


def test_references(text: str, base: Path) -> tuple[set[str], list[str]]:
    """The tests `text` names (linked test files, `test_*.py` files, `test_*` functions, `file.py::test_*`) and
    the names among them that do not exist."""
    functions, files = _test_functions(), {p.name for p in (ROOT / "tests").rglob("test_*.py")}
    found, missing = set(), []
    for target in LINK.findall(text):
        path = target.partition("#")[0]
        if "tests/" in path:
            found.add(path)
            if not (base / path).resolve().exists():
                missing.append(path)
    for code in re.findall(r"`([^`\n]+)`", text):
        for ref in re.findall(r"(?:[\w/]+\.py::)?test_\w+(?:\.py)?(?:\[[^\]]*\])?", code):
            found.add(ref)
            file, _, func = ref.rpartition("::")
            func = re.sub(r"\[.*\]$", "", func)
            if func.endswith(".py"):
                ok = func in files
            else:
                ok = func in functions and (not file or Path(file).name in files)
            if not ok:
                missing.append(ref)
    return found, missing


test_references.__test__ = False  # a helper, not a test


def _units(text: str) -> list[tuple[str, str]]:
    """(section, text) of every paragraph and bullet item of a doc, outside code blocks and tables."""
    out, section, block = [], "", []
    in_code = False

    def flush():
        if block:
            out.append((section, " ".join(block)))
            block.clear()

    for line in text.splitlines():
        if line.startswith("```"):
            in_code = not in_code
            flush()
            continue
        if in_code or line.startswith(("|", "    ")):
            flush()
            continue
        if line.startswith("#"):
            flush()
            section = line.lstrip("#").strip() if line.startswith("##") else ""  # the page's intro promises nothing
            continue
        if not line.strip() or line.startswith("- "):
            flush()
        if line.strip():
            block.append(line.strip())
    flush()
    return out


def test_every_guarantee_names_a_test_that_exists():
    """Each paragraph and bullet of docs/guarantees.md that promises something names a test (a lead-in ending
    with ":" excepted), and every test the page names exists."""
    text = GUARANTEES.read_text()
    _, missing = test_references(text, GUARANTEES.parent)
    assert not missing, f"docs/guarantees.md names tests that do not exist: {missing}"
    untested = [unit[:120] for section, unit in _units(text)
                if section and section not in NOT_PROMISES and not unit.rstrip().endswith(":")
                and not test_references(unit, GUARANTEES.parent)[0]]
    assert not untested, "promises in docs/guarantees.md that name no test:\n" + "\n".join(untested)


def test_known_gaps_are_listed_each_with_its_tracking_or_its_test():
    """docs/guarantees.md keeps a "Known gaps" section; each gap names the issue that tracks it or a test."""
    units = [u for section, u in _units(GUARANTEES.read_text()) if section == "Known gaps"]
    gaps = [u for u in units if u.startswith("- ")]
    assert len(gaps) >= 3, "docs/guarantees.md has no (or an almost empty) `## Known gaps` section"
    bare = [g[:120] for g in gaps if not re.search(r"\bissue \d+\b", g) and not test_references(g, GUARANTEES.parent)[0]]
    assert not bare, "known gaps that name neither an issue nor a test:\n" + "\n".join(bare)


TROUBLESHOOTING = ROOT / "docs" / "troubleshooting.md"


def _error_classes() -> list[str]:
    tree = ast.parse((ROOT / "accelerate_memsafe" / "errors.py").read_text())
    return [node.name for node in tree.body if isinstance(node, ast.ClassDef)]


def _message_sources() -> tuple[str, list[re.Pattern]]:
    """What messages are made of: every string literal of the package joined, and every f-string line as a
    pattern (its fixed parts, anything in place of a `{...}`; those with at least 15 fixed characters)."""
    literals, patterns = [], []
    for path in (ROOT / "accelerate_memsafe").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                literals.append(node.value)
            elif isinstance(node, ast.JoinedStr):
                pieces = [[]]
                for part in node.values:
                    if isinstance(part, ast.Constant):
                        first, *rest = str(part.value).split("\n")
                        pieces[-1].append(first)
                        pieces.extend([line] for line in rest)
                    else:
                        pieces[-1].append(None)
                for piece in pieces:
                    if sum(len(p) for p in piece if p) >= 15:
                        patterns.append(re.compile("".join(".+?" if p is None else re.escape(p) for p in piece)))
    return "\0".join(literals), patterns


def test_every_error_class_has_a_troubleshooting_entry():
    headings = [line for line in TROUBLESHOOTING.read_text().splitlines() if line.startswith("#")]
    missing = [name for name in _error_classes() if not any(f"`{name}`" in h for h in headings)]
    assert not missing, f"docs/troubleshooting.md has no entry (a heading naming it) for: {missing}"


def test_troubleshooting_excerpts_are_messages_the_code_writes():
    """Each line of a ```text excerpt (but commands) shares a run of 30 characters with a string literal of the
    package, or holds a whole line of one of its f-strings: the excerpts are real messages, not paraphrases, and
    a reworded message shows up here."""
    corpus, patterns = _message_sources()
    paraphrase = "CheckpointError: the checkpoint looks broken, please try another one"
    assert not any(paraphrase[i:i + 30] in corpus for i in range(len(paraphrase) - 29))
    assert not any(p.search(paraphrase) for p in patterns)
    invented = []
    for block in re.findall(r"```text\n(.*?)```", TROUBLESHOOTING.read_text(), flags=re.S):
        for line in block.splitlines():
            line = line.strip()
            if line.startswith("$") or len(line) < 40:
                continue
            if not any(line[i:i + 30] in corpus for i in range(len(line) - 29)) and \
                    not any(p.search(line) for p in patterns):
                invented.append(line[:120])
    assert not invented, "excerpts in docs/troubleshooting.md that no message of the code contains:\n" + "\n".join(invented)


def test_every_stage_is_documented():
    pipeline = (ROOT / "docs" / "pipeline.md").read_text()
    missing = [name for name in STAGE_REGISTRY if f"`{name}`" not in pipeline]
    assert not missing, f"docs/pipeline.md does not describe stage(s): {missing}"


# --------------------------------------------------------------------------------------------------------------
# Benchmark figures quoted in the docs come from the tables the benchmarks write.
#
# In docs/benchmarks.md each benchmark's output (its caption and tables, as `--markdown FILE` appends them) sits
# between `<!-- table: ID -->` and `<!-- /table -->`. Anywhere in README.md or docs/*.md, a figure taken from such
# a table carries, right after the number (and its unit), a marker naming its cell:
#
#     517 MiB<!-- fig: prepare-250m-2ranks | setting=fp32, path=memsafe, rank=0 | RssAnon peak (MiB) -->
#     0.019<!-- fig: peft-reload-100m | path=plugin reload_adapters | live tensor peak (MiB) ÷ peft-reload-100m | path=peft load_adapter | live tensor peak (MiB) -->
#
# `ID | KEY=VALUE, ... | COLUMN`: the region (`ID#N`: only its N-th table), the row (every KEY is a column
# header, VALUE its cell without backticks) and the column header (`NAME[2]` for the second column of that name);
# across the region's tables exactly one cell must match. `A ÷ B` quotes the ratio of two cells. The quoted number must equal the cell
# rounded to the decimals it is written with (never more decimals than the cell has).
# --------------------------------------------------------------------------------------------------------------

BENCHMARKS = ROOT / "docs" / "benchmarks.md"
# the compatibility pages are written by `python -m tests.conformance --out`: counts of cells, no benchmark figures
QUOTING_DOCS = [ROOT / "README.md"] + sorted(p for p in (ROOT / "docs").glob("*.md") if not p.name.startswith("compatibility"))
TABLE_START = re.compile(r"^<!-- table: ([A-Za-z0-9_.\-]+) -->\s*$")
TABLE_END = re.compile(r"^<!-- /table -->\s*$")
FIGURE = re.compile(r"<!-- fig: (.*?) -->", re.S)
QUOTED = re.compile(r"([+-]?\d+(?:\.\d+)?)(?:\s?(?:MiB|GiB|KiB|MB|GB|ms|s|×|x))?\**\s*$")
NUMERIC_CELL = re.compile(r"^[+-]?\d+(?:\.\d+)?$")


@dataclass
class _Table:
    header: list[str]
    rows: list[list[str]]
    line: int


@dataclass
class _Region:
    name: str
    start: int
    end: int = 0
    tables: list[_Table] = field(default_factory=list)


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _plain(cell: str) -> str:
    return cell.replace("`", "").strip()


def parse_regions(text: str) -> tuple[dict[str, _Region], list[str]]:
    """The `<!-- table: ID -->` ... `<!-- /table -->` regions of a benchmarks page, and what is wrong with them
    (a table outside a region, an id used twice, a region never closed)."""
    regions: dict[str, _Region] = {}
    problems: list[str] = []
    current: _Region | None = None
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        start, end = TABLE_START.match(line), TABLE_END.match(line)
        if start:
            name = start.group(1)
            if current is not None:
                problems.append(f"line {i + 1}: `<!-- table: {name} -->` inside region `{current.name}` (line "
                                f"{current.start}); close that one with `<!-- /table -->` first")
            if name in regions:
                problems.append(f"line {i + 1}: the table id `{name}` is used twice")
            current = regions[name] = _Region(name, i + 1)
        elif end:
            if current is None:
                problems.append(f"line {i + 1}: `<!-- /table -->` without a `<!-- table: ID -->` before it")
            else:
                current.end, current = i + 1, None
        elif line.startswith("|"):
            first, block = i, []
            while i < len(lines) and lines[i].startswith("|"):
                block.append(lines[i])
                i += 1
            if current is None:
                problems.append(f"line {first + 1}: a table outside any `<!-- table: ID -->` ... `<!-- /table -->` "
                                "region: put the benchmark's output between such markers (a new id) so docs can quote it")
            else:
                current.tables.append(_Table(_cells(block[0]), [_cells(r) for r in block[2:]], first + 1))
            continue
        i += 1
    if current is not None:
        problems.append(f"region `{current.name}` (line {current.start}) is never closed with `<!-- /table -->`")
    return regions, problems


def resolve_cell(ref: str, regions: dict[str, _Region]) -> str:
    """The text of the one cell `ID | KEY=VALUE, ... | COLUMN` names (raises ValueError saying why not)."""
    parts = [p.strip() for p in ref.split("|")]
    if len(parts) != 3:
        raise ValueError(f"`{ref}` is not `ID | KEY=VALUE, ... | COLUMN`")
    name, selector, column = parts
    name, _, table_no = name.partition("#")
    if name not in regions:
        raise ValueError(f"no table region `{name}` in docs/benchmarks.md (known: {sorted(regions)})")
    tables = regions[name].tables
    if table_no:
        if not table_no.isdigit() or not 1 <= int(table_no) <= len(tables):
            raise ValueError(f"region `{name}` has {len(tables)} table(s), not a table #{table_no}")
        tables = [tables[int(table_no) - 1]]
    keys = {}
    for pair in filter(None, (s.strip() for s in selector.split(","))):
        key, eq, value = pair.partition("=")
        if not eq:
            raise ValueError(f"`{pair}` in `{ref}` is not KEY=VALUE")
        keys[key.strip()] = value.strip()
    nth = re.fullmatch(r"(.*)\[(\d+)\]", column)
    column, index = (nth.group(1).strip(), int(nth.group(2))) if nth else (column, None)
    found = []
    for table in tables:
        where = [j for j, h in enumerate(table.header) if h == column]
        if not where or any(k not in table.header for k in keys):
            continue
        if len(where) > 1 and index is None:
            raise ValueError(f"column `{column}` appears {len(where)} times in the table at line {table.line}: "
                             f"write `{column}[N]`")
        if index is not None and index > len(where):
            raise ValueError(f"column `{column}[{index}]`: the table at line {table.line} has {len(where)} of them")
        j = where[(index or 1) - 1]
        for row in table.rows:
            if len(row) == len(table.header) and all(_plain(row[table.header.index(k)]) == v for k, v in keys.items()):
                found.append(row[j])
    if len(found) != 1:
        raise ValueError(f"`{ref}` matches {len(found)} cells in region `{name}`, not exactly one")
    return found[0]


def _cell_number(ref: str, regions: dict[str, _Region]) -> tuple[float, int]:
    text = _plain(resolve_cell(ref, regions))
    if not NUMERIC_CELL.match(text):
        raise ValueError(f"`{ref}` is the cell {text!r}, not a number")
    return float(text), len(text.partition(".")[2])


def check_figure(quoted: str, spec: str, regions: dict[str, _Region]) -> str | None:
    """None if the number `quoted` is what the marker `spec` says (a cell, or `A ÷ B`), else what is wrong."""
    try:
        refs = [r.strip() for r in spec.split("÷")]
        if len(refs) == 1:
            value, cell_decimals = _cell_number(refs[0], regions)
        elif len(refs) == 2:
            (a, _), (b, _) = (_cell_number(r, regions) for r in refs)
            value, cell_decimals = a / b, 99
        else:
            raise ValueError("a marker holds one cell reference or one `A ÷ B`")
    except ValueError as exc:
        return str(exc)
    decimals = len(quoted.partition(".")[2])
    if decimals > cell_decimals:
        return f"{quoted} has more decimals than the cell ({value})"
    if abs(abs(float(quoted)) - value) > 0.5 * 10**-decimals + 1e-9:
        return f"the doc says {quoted}, the table says {value:.{max(decimals, 2) if len(refs) == 2 else cell_decimals}f}"
    return None


def _blank(m: re.Match) -> str:
    return re.sub(r"[^\n]", " ", m.group())


def _blank_code(text: str) -> str:
    """`text` with fenced blocks and inline code blanked out (same length and lines)."""
    return re.sub(r"`[^`\n]*`", _blank, re.sub(r"```.*?```", _blank, text, flags=re.S))


def quoted_figures(text: str) -> list[tuple[int, str, str]]:
    """(line, quoted number, marker spec) for every `<!-- fig: ... -->` outside code in `text`; the number is the
    one right before the marker ("" when there is none)."""
    out = []
    for m in FIGURE.finditer(_blank_code(text)):
        m = FIGURE.match(text, m.start())
        before = QUOTED.search(text[max(0, m.start() - 40):m.start()])
        out.append((text.count("\n", 0, m.start()) + 1, before.group(1) if before else "", " ".join(m.group(1).split())))
    return out


def _benchmark_regions() -> dict[str, _Region]:
    return parse_regions(BENCHMARKS.read_text())[0]


def test_every_benchmark_table_sits_in_a_named_region():
    regions, problems = parse_regions(BENCHMARKS.read_text())
    assert not problems, "docs/benchmarks.md:\n" + "\n".join(problems)
    empty = [name for name, r in regions.items() if not r.tables]
    assert not empty, f"docs/benchmarks.md: region(s) without a table: {empty}"


@pytest.mark.parametrize("doc", QUOTING_DOCS, ids=lambda p: p.name)
def test_every_quoted_figure_is_its_table_cell(doc):
    regions = _benchmark_regions()
    wrong = []
    for line, quoted, spec in quoted_figures(doc.read_text()):
        problem = "no number right before the marker" if not quoted else check_figure(quoted, spec, regions)
        if problem:
            wrong.append(f"{doc.relative_to(ROOT)}:{line}: {problem} [fig: {spec}]")
    assert not wrong, "figures that do not match docs/benchmarks.md:\n" + "\n".join(wrong)


# A figure-looking number: a size or a duration ("517 MiB", "1.37 s") or a number compared with another ("517 vs
# 401", "519 / 551"), in a sentence that talks about measurements (the words below); any ratio written "1.29×";
# in a table, any cell that is a number. It must carry a `<!-- fig: ... -->` marker, unless ALLOWED says why it is not
# a benchmark figure. Code, comments, link targets and docs/benchmarks.md's generated regions are not prose.
UNIT = r"(?:MiB|GiB|KiB|MB|GB|TB|KB|ms|s)(?![\w])"
SIZE_OR_TIME = re.compile(rf"(?<![\w.\-/=·^])(?<!\+ )[+-]?\d+(?:\.\d+)?\s?{UNIT}")
RATIO = re.compile(r"(?<![\w.\-/=·^])\d+(?:\.\d+)?[×x](?![\w])")
COMPARED = re.compile(r"(?<![\w.\-/=·^])([+-]?\d+(?:\.\d+)?)\s(?:vs\.?|/)\s([+-]?\d+(?:\.\d+)?)(?![\w.])")
CELL_NUMBER = re.compile(rf"(?<=\|)\s*([+-]?(?:\d+\.\d+|\d\d+)(?:\s?{UNIT}|[×x])?)\s*(?=\|)")
MARKED_AFTER = re.compile(rf"(?:\s?{UNIT}|[×x])?\**\0")
BENCHMARK_WORDS = re.compile(
    r"\b(?:measured|measures?|measurements?|benchmarks?|peaks?|wall|stock|transformers|DCP|RssAnon|RSS|ratio|"
    r"faster|slower|vs|took|takes|costs?|growth|grows|alive|in this run|private memory|allocates?)\b",
    re.I,
)
# (file, snippet): a figure inside one of these snippets is not a benchmark figure (a default, a test's own
# parameter, arithmetic on assumed sizes, a figure from the seeds' reports, a target). A snippet that no longer
# occurs fails `test_the_figure_allow_list_is_current`.
ALLOWED: list[tuple[str, str]] = [
    ("docs/benchmarks.md", "2 CPU cores, 24 GiB, no GPU"),  # the machine
    ("docs/benchmarks.md", "2 ms"),  # the memory sampler's interval
    ("docs/benchmarks.md", "the plugin's default being 10 ms"),  # memory_sample_interval_s's default
    ("docs/configuration.md", "(16 MiB with the defaults)"),  # checked by test_the_documented_bucket_size_...
    # option defaults (checked against the code by test_documented_defaults_are_the_code_defaults)
    ("docs/configuration.md", "(64 MiB)"),
    ("docs/configuration.md", "(5 GB)"),
    ("docs/prepare.md", "| 64 MiB |"),
    ("docs/prepare.md", "| 600 |"),
    ("docs/prepare.md", "16 MiB by default"),  # bucket_bytes // (prefetch_buckets + 2) with the defaults
    ("docs/prepare.md", "one 16 MiB chunk"),
    ("docs/prepare.md", "(+ 4 KiB of collective scratch)"),  # the structural test's allowance
    ("docs/guarantees.md", "then a 1 ms"),  # the NCCL wait's poll interval
    ("docs/offloaded_save.md", "in pieces of at most 32 MiB"),  # shard_writer.CHUNK_BYTES
    ("docs/offloaded_save.md", "whole 4 KiB blocks written"),  # the O_DIRECT block size
]


def _mask(text: str, *, generated: bool) -> str:
    """`text` with code, comments (a figure marker becomes \\0), link targets and, for docs/benchmarks.md, the
    generated regions blanked out, same length and lines."""

    text = re.sub(r"```.*?```", _blank, text, flags=re.S)
    text = re.sub(r"<!-- fig: .*?-->", lambda m: "\0" + _blank(m)[1:], text, flags=re.S)
    text = re.sub(r"<!--(?! fig: ).*?-->", _blank, text, flags=re.S)
    text = re.sub(r"`[^`\n]*`", _blank, text)
    text = re.sub(r"\]\([^)\s]*\)", _blank, text)
    if generated:
        lines = text.split("\n")
        for region in parse_regions(BENCHMARKS.read_text())[0].values():
            for i in range(region.start - 1, region.end):
                lines[i] = " " * len(lines[i])
        text = "\n".join(lines)
    return text


def _sentence(text: str, pos: int) -> str:
    line_start = text.rfind("\n", 0, pos) + 1
    if text.startswith("|", line_start):
        return text[line_start:text.find("\n", pos)]
    start = max(text.rfind(s, 0, pos) for s in (". ", ".\n", "\n\n"))
    ends = [e for e in (text.find(s, pos) for s in (". ", ".\n", "\n\n")) if e >= 0]
    return text[start + 1:min(ends, default=len(text))]


def _candidates(text: str) -> dict[int, tuple[int, bool]]:
    """start -> (end, always checked) of every figure-looking number in masked `text`."""
    found: dict[int, tuple[int, bool]] = {}
    for m in SIZE_OR_TIME.finditer(text):
        found[m.start()] = (m.end(), False)
    for m in COMPARED.finditer(text):
        for g in (1, 2):
            found.setdefault(m.start(g), (m.end(g), False))
    for m in RATIO.finditer(text):
        found[m.start()] = (m.end(), True)
    for line in re.finditer(r"^\|.*$", text, flags=re.M):
        for m in CELL_NUMBER.finditer(line.group()):
            found.setdefault(line.start() + m.start(1), (line.start() + m.end(1), True))
    return found


def unmarked_figures(doc: Path) -> list[str]:
    """`file:line: figure in its sentence` for each benchmark-looking figure in `doc` without a marker."""
    raw = doc.read_text()
    text = _mask(raw, generated=doc == BENCHMARKS)
    rel = str(doc.relative_to(ROOT))
    allowed = [(m.start(), m.end()) for f, snippet in ALLOWED if f == rel for m in re.finditer(re.escape(snippet), raw)]
    out = []
    for start, (end, always) in sorted(_candidates(text).items()):
        number_end = start + len(re.match(r"[+-]?\d+(?:\.\d+)?", text[start:]).group())
        if MARKED_AFTER.match(text, number_end) or any(a <= start and end <= b for a, b in allowed):
            continue
        sentence = _sentence(text, start)
        if always or text[text.rfind("\n", 0, start) + 1:].startswith("|") or BENCHMARK_WORDS.search(sentence):
            out.append(f"{rel}:{raw.count(chr(10), 0, start) + 1}: {text[start:end].strip()!r} in "
                       f"{' '.join(sentence.split())[:160]!r}")
    return out


@pytest.mark.parametrize("doc", QUOTING_DOCS, ids=lambda p: p.name)
def test_no_benchmark_figure_without_its_source(doc):
    found = unmarked_figures(doc)
    assert not found, (
        "figures that look like benchmark results but name no table cell; add `<!-- fig: ID | KEY=VALUE | COLUMN -->`"
        " after each (see the top of this section), or, if it is not a benchmark figure, add it to ALLOWED:\n"
        + "\n".join(found)
    )


def test_the_figure_allow_list_is_current():
    stale = [(f, s) for f, s in ALLOWED if s not in (ROOT / f).read_text()]
    assert not stale, f"ALLOWED entries whose text is no longer in the doc: {stale}"


def _cell_key(ref: str) -> tuple[str, frozenset, str]:
    name, selector, column = (p.strip() for p in ref.split("|"))
    pairs = frozenset(tuple(x.strip() for x in kv.split("=", 1)) for kv in selector.split(",") if kv.strip())
    return name, pairs, column


def cells_worse_than_stock(region: _Region) -> list[str]:
    """References of the plugin's cells that are worse (higher) than stock's in the same setting and rank:
    private memory, RSS or wall, in every table of `region` that has a `stock` path."""
    out = []
    for t in region.tables:
        if "path" not in t.header:
            continue
        keys = [h for h in ("setting", "mesh", "phase", "max_shard_size", "rank") if h in t.header]
        metrics = [h for h in t.header if re.search(r"\b(?:RssAnon|RSS|wall)\b", h) and t.header.count(h) == 1]
        rows = [dict(zip(t.header, map(_plain, r))) for r in t.rows if len(r) == len(t.header)]
        stock = {tuple(r[k] for k in keys): r for r in rows if r["path"] == "stock"}
        for r in rows:
            base = stock.get(tuple(r[k] for k in keys))
            if base is None or not r["path"].startswith(("memsafe", "plugin")):
                continue
            for h in metrics:
                if NUMERIC_CELL.match(r[h]) and NUMERIC_CELL.match(base[h]) and float(r[h]) > float(base[h]):
                    where = ", ".join(f"{k}={r[k]}" for k in (*keys, "path"))
                    out.append(f"{region.name} | {where} | {h}")
    return out


def test_the_readme_headline_says_where_the_plugin_is_worse_than_stock():
    """The README's figures face every prepare table, and quote each figure in which the plugin did worse than
    stock accelerate (a headline that only picks the good rows fails here)."""
    regions = _benchmark_regions()
    quoted = [spec for _, _, spec in quoted_figures((ROOT / "README.md").read_text())]
    cited = {ref.split("|")[0].strip().partition("#")[0] for spec in quoted for ref in spec.split("÷")}
    assert any(name.startswith("prepare-") for name in regions), "docs/benchmarks.md has no prepare table region"
    uncited = [name for name in regions if name.startswith("prepare-") and name not in cited]
    assert not uncited, f"README.md quotes no figure of the prepare table(s) {uncited} (docs/benchmarks.md)"
    named = {_cell_key(ref) for spec in quoted for ref in spec.split("÷")[:1]}
    hidden = [ref for name in cited if name in regions for ref in cells_worse_than_stock(regions[name])
              if _cell_key(ref) not in named]
    assert not hidden, "README.md quotes tables in which the plugin is worse than stock but not these figures:\n" + \
        "\n".join(hidden)


SAMPLE_BENCHMARKS = """
<!-- table: demo -->
demo, Llama `1g` (2026-01-01T00:00:00Z):

| setting | path | rank | RssAnon peak (MiB) | wall (s) |
|---|---|---|---|---|
| fp32 | stock | 0 | 401 | 1.50 |
| fp32 | memsafe | 0 | 517 | 1.37 |

| setting | ratio | ratio |
|---|---|---|
| fp32 | 1.29 | 0.91 |
<!-- /table -->
"""


def test_the_figure_check_catches_a_wrong_figure_and_a_bad_reference():
    regions, problems = parse_regions(SAMPLE_BENCHMARKS)
    assert not problems and len(regions["demo"].tables) == 2
    ref = "demo | setting=fp32, path=memsafe, rank=0 | RssAnon peak (MiB)"
    assert check_figure("517", ref, regions) is None
    assert "the table says 517" in check_figure("518", ref, regions)
    assert check_figure("1.37", "demo | path=memsafe | wall (s)", regions) is None
    assert check_figure("1.4", "demo | path=memsafe | wall (s)", regions) is None        # rounded is fine
    assert "more decimals" in check_figure("1.370", "demo | path=memsafe | wall (s)", regions)
    assert check_figure("1.29", f"{ref} ÷ demo | setting=fp32, path=stock, rank=0 | RssAnon peak (MiB)", regions) is None
    assert check_figure("0.91", "demo | setting=fp32 | ratio[2]", regions) is None
    assert "appears 2 times" in check_figure("1.29", "demo | setting=fp32 | ratio", regions)
    assert "matches 2 cells" in check_figure("401", "demo | setting=fp32 | RssAnon peak (MiB)", regions)
    assert "no table region" in check_figure("401", "other | path=stock | RssAnon peak (MiB)", regions)
    assert "not a table #3" in check_figure("401", "demo#3 | path=stock | RssAnon peak (MiB)", regions)
    assert quoted_figures("peaks at 517 MiB<!-- fig: x -->, **1.29×**<!-- fig: y -->") == [(1, "517", "x"), (1, "1.29", "y")]
    assert [_cell_key(r) for r in cells_worse_than_stock(regions["demo"])] == [_cell_key(ref)]
    _, outside = parse_regions("| a |\n|---|\n| 1 |\n")
    assert outside and "outside any" in outside[0]
