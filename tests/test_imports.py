"""The package's imports, read from its source (tools/importgraph.py): no circle, and no
package import placed inside a function (where it would hide one)."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("importgraph", ROOT / "tools" / "importgraph.py")
importgraph = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(importgraph)


def test_no_import_circle():
    edges = importgraph.graph(importgraph.read())
    assert importgraph.circles(edges) == []
    assert {"hardware", "matmul", "trace", "exercises", "errors"} <= set(edges)  # the graph was read


def test_no_package_import_inside_a_function():
    assert importgraph.nested_imports(importgraph.read()) == []


def test_the_checks_find_what_they_look_for(tmp_path):
    (tmp_path / "a.py").write_text("from .b import x\n")
    (tmp_path / "b.py").write_text("def f():\n    from . import a\n    return a\n")
    (tmp_path / "c.py").write_text("import amp_lessons.a\n")
    trees = importgraph.read(tmp_path)
    edges = importgraph.graph(trees)
    assert edges == {"a": {"b"}, "b": {"a"}, "c": {"a"}}
    assert importgraph.circles(edges) == [["a", "b"]]
    assert importgraph.nested_imports(trees) == ["b.py:2 imports a"]


def test_the_instruments_do_not_import_the_verdicts():
    """hardware, matmul and trace return facts; devicechecks turns them into verdicts."""
    edges = importgraph.graph(importgraph.read())
    for instrument in ("hardware", "trace", "measure", "breakdown"):
        assert "claims" not in edges[instrument] and "devicechecks" not in edges[instrument], instrument
    assert "devicechecks" not in edges["matmul"]
