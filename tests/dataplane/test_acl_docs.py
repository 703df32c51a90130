"""docs/architecture.md's key-family table and the ACL users the generator writes agree, user by user.

The table is what a reader of the docs trusts (who writes, who only appends, who reads each key family); the users are
what Redis enforces. Each row is read back from the markdown and checked against the rights ``onlinerl.dataplane.acl``
generates for every component (root key selectors and the append selector), so neither can drift alone.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from onlinerl.dataplane import acl
from onlinerl.dataplane.contract import FAMILIES, Component

DOC = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"
MARKER = "<!-- contract-table:"
JOB = "docs-job"


def doc_rows() -> dict[str, dict[str, object]]:
    """The table under the marker: family -> pattern, type, writes, appends, reads, script reads (starred)."""
    lines = DOC.read_text().split(MARKER, 1)[1].splitlines()[1:]
    rows: dict[str, dict[str, object]] = {}
    for line in lines[2:]:
        line = line.strip()
        if not line.startswith("|"):
            break
        name, pattern, rtype, writes, appends, reads = (c.strip() for c in line.strip("|").split("|"))

        def users(cell: str) -> set[str]:
            return set(re.findall(r"`([a-z]+)`", cell))

        rows[name] = {
            "pattern": pattern.strip("`"),
            "type": rtype,
            "writes": users(writes),
            "appends": users(appends),
            "reads": users(reads),
            "script": set(re.findall(r"`([a-z]+)`\\\*", reads)),
        }
    return rows


def test_the_table_lists_every_family_of_the_contract() -> None:
    rows = doc_rows()
    assert list(rows) == [f.name for f in FAMILIES]
    for f in FAMILIES:
        row = rows[f.name]
        assert (row["pattern"], row["type"]) == (f.pattern, f.redis_type), f.name
        assert row["writes"] == {c.value for c in f.writers}, f.name
        assert row["appends"] == {c.value for c in f.appenders}, f.name
        assert row["reads"] == {c.value for c in f.readers}, f.name


@pytest.mark.parametrize("component", [c for c in Component if c is not Component.ADMIN], ids=str)
def test_the_generated_user_grants_what_the_table_says(component: Component) -> None:
    """Root ``~`` (read+write) = the rows it writes or script-reads; root ``%R~`` = the rows it only appends to or
    reads; the append selector's keys = its write keys plus the rows it appends to, with XADD and scripts only."""
    prefix = acl.key_prefix(JOB)
    me = component.value
    rows = doc_rows()
    write = {r["pattern"] for r in rows.values() if me in r["writes"] or me in r["script"]}
    append = {r["pattern"] for r in rows.values() if me in r["appends"]}
    read = {r["pattern"] for r in rows.values() if me in r["reads"] and me not in r["script"]}
    selectors = acl.key_selectors(component, JOB)
    assert {s.removeprefix("~" + prefix) for s in selectors if s.startswith("~")} == write
    assert {s.removeprefix("%R~" + prefix) for s in selectors if s.startswith("%R~")} == append | read
    selector = acl.append_selector(component, JOB)
    if not append:
        assert selector is None
        return
    assert selector is not None
    parts = selector.strip("()").split()
    assert {p.removeprefix("~" + prefix) for p in parts if p.startswith("~")} == write | append
    assert {p for p in parts if p.startswith("+")} == {f"+{c}" for c in acl.APPEND}
    assert "xtrim" not in selector and "+del" not in selector


def test_the_table_says_who_may_change_the_policy_and_the_samples() -> None:
    """The two rights the docs promise in words: the gateway only reads the policy table; feedback only appends."""
    rows = doc_rows()
    assert "gateway" in rows["policy table"]["reads"] and "gateway" not in rows["policy table"]["writes"]
    assert rows["samples"]["writes"] == {"trainer"} and rows["samples"]["appends"] == {"feedback"}
