"""tools/nbtool.py: stored notebooks that change only when the lesson does."""

import sys
from pathlib import Path

import nbformat

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import nbtool  # noqa: E402


def test_consecutive_prints_are_stored_as_one_output():
    out = nbformat.v4.new_output
    outputs = [out("stream", name="stdout", text="a\n"), out("stream", name="stdout", text="b\n"),
               out("stream", name="stderr", text="w\n"), out("stream", name="stdout", text="c\n"),
               out("execute_result", {"text/plain": "1"}, execution_count=1)]
    merged = nbtool.merged_streams(outputs)
    assert [(o.output_type, o.get("name"), o.get("text")) for o in merged] == [
        ("stream", "stdout", "a\nb\n"), ("stream", "stderr", "w\n"), ("stream", "stdout", "c\n"),
        ("execute_result", None, None)]


def test_widget_ids_depend_on_the_lesson_and_the_order_not_on_the_run():
    def notebook(ids):
        cell = nbformat.v4.new_code_cell("w", execution_count=1, id="c1")
        cell.outputs = [nbformat.v4.new_output("display_data", {
            "text/plain": "VBox(...)", "application/vnd.jupyter.widget-view+json": {"model_id": ids[0]}})]
        nb = nbformat.v4.new_notebook(cells=[cell])
        nb.metadata["widgets"] = {"application/vnd.jupyter.widget-state+json": {"state": {
            ids[0]: {"state": {"children": [f"IPY_MODEL_{ids[1]}"]}}, ids[1]: {"state": {"value": 3}}}}}
        return nb

    a = nbtool.stable_widget_ids(notebook(["a" * 32, "b" * 32]), "01_x")
    b = nbtool.stable_widget_ids(notebook(["c" * 32, "d" * 32]), "01_x")
    assert nbformat.writes(a) == nbformat.writes(b)
    assert "a" * 32 not in nbformat.writes(a)
