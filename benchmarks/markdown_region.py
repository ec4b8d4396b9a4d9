"""Writes a benchmark's tables into a markdown page: each ``<!-- table: ID -->`` ... ``<!-- /table -->`` region of the
new text replaces the region of the same ``ID`` already in the page, in place; a region the page does not have yet is
appended at its end. So ``--markdown docs/benchmarks.md`` re-run with the same settings updates the page instead of
leaving two regions with one ID (which ``tests/unit/test_docs.py`` refuses) or a stale table that quoted figures
still point at.

    >>> import tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "page.md")
    >>> write_tables(path, "\\n<!-- table: a -->\\nold\\n<!-- /table -->\\n")
    ['a (new)']
    >>> write_tables(path, "\\n<!-- table: a -->\\nnew\\n<!-- /table -->\\n")
    ['a (replaced)']
    >>> open(path).read()
    '\\n<!-- table: a -->\\nnew\\n<!-- /table -->\\n'
"""

from __future__ import annotations

import re
from pathlib import Path

_REGION = re.compile(r"<!-- table: (?P<id>[^ ]+) -->\n.*?<!-- /table -->", re.S)


def write_tables(path: str | Path, text: str) -> list[str]:
    """Puts every table region of ``text`` into the page at ``path`` (created when missing), in place of the region
    with the same ID, or at the end. When no region of ``text`` is in the page yet, the whole of ``text`` (a heading
    above the regions included) is appended.

    Returns:
        One line per region, ``"ID (replaced)"`` or ``"ID (new)"``, for the script's log.

    Raises:
        ValueError: If the page holds a region's ID twice (fix the page first: which one to replace is not clear).
    """
    path = Path(path)
    page = path.read_text(encoding="utf-8") if path.exists() else ""
    regions = list(_REGION.finditer(text))
    done, appended = [], []
    for region in regions:
        rid = region["id"]
        found = [m for m in _REGION.finditer(page) if m["id"] == rid]
        if len(found) > 1:
            raise ValueError(f"{path}: the table id `{rid}` is there {len(found)} times; remove the stale region(s) "
                             "and run again")
        if found:
            page = page[:found[0].start()] + region.group(0) + page[found[0].end():]
            done.append(f"{rid} (replaced)")
        else:
            appended.append(region.group(0))
            done.append(f"{rid} (new)")
    if len(appended) == len(regions):  # nothing replaced: the whole text goes at the end, as it was written
        page += text
    else:
        page += "".join(f"\n{region}\n" for region in appended)
    path.write_text(page, encoding="utf-8")
    return done
