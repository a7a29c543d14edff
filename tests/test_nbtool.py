"""tools/nbtool.py: stored notebooks that change only when the lesson does."""

import subprocess
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


def _lesson(tmp_path, outputs=("4\n",), name="03_x.ipynb"):
    """A small lesson as `execute` stores it, with its jupytext pair."""
    cell = nbformat.v4.new_code_cell("print(2 + 2)", execution_count=1, id="c1")
    cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text=t) for t in outputs]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# x", id="m1"), cell])
    nb.metadata["jupytext"] = {"formats": "ipynb,py:percent"}
    nbtool.stamp(nb)
    path = tmp_path / name
    nbformat.write(nb, path)
    nbtool.jupytext.write(nb, path.with_suffix(".py"), fmt=nbtool.FMT)
    return path


def _save_a_run(path, text="4 (my run)\n", source=None):
    """What JupyterLab saves after a learner's run: new outputs, the metadata kept."""
    nb = nbformat.read(path, as_version=4)
    nb.cells[1].outputs = [nbformat.v4.new_output("stream", name="stdout", text=text)] if text else []
    if source is not None:
        nb.cells[1].source = source
    nbformat.write(nb, path)


def test_a_run_saved_over_the_stored_outputs_is_told_apart_from_them(tmp_path, capsys):
    path = _lesson(tmp_path)
    assert nbtool.outputs_state(nbformat.read(path, as_version=4)) == "stored"
    assert nbtool.check_pairs([path]) == 0
    _save_a_run(path)
    assert nbtool.outputs_state(nbformat.read(path, as_version=4)) == "run"
    assert nbtool.check_pairs([path]) == 1
    out = capsys.readouterr().out
    assert "its outputs were saved by a run (in JupyterLab, or cleared)" in out and "`make reset`" in out
    assert "1 pairs in sync, 0 out of sync; 0 with their stored outputs, 1 without" in out
    _save_a_run(path, text=None)  # cleared
    assert nbtool.outputs_state(nbformat.read(path, as_version=4)) == "run"
    nb = nbformat.read(path, as_version=4)
    del nb.metadata["amp_lessons"]
    assert nbtool.outputs_state(nb) == "unstamped"


def _git(cwd, *args):
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=cwd, check=True,
                   capture_output=True)


def test_reset_puts_back_the_stored_outputs_and_leaves_an_edited_lesson_alone(tmp_path, capsys):
    run_only, edited = _lesson(tmp_path, name="03_x.ipynb"), _lesson(tmp_path, name="04_y.ipynb")
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "commit", "-qm", "lessons")
    stored = run_only.read_text()
    _save_a_run(run_only)
    _save_a_run(edited, source="print(2 + 3)")
    edited_text = edited.read_text()
    assert nbtool.reset([run_only, edited]) == 1
    out = capsys.readouterr().out
    assert run_only.read_text() == stored and f"{run_only}: stored outputs put back" in out
    assert edited.read_text() == edited_text and "its code or prose was edited" in out
    assert nbtool.check_pairs([run_only]) == 0


def test_reset_outside_a_clone_says_where_the_stored_outputs_are(tmp_path, capsys):
    path = _lesson(tmp_path)
    _save_a_run(path)
    assert nbtool.reset([path]) == 1
    assert "not reset: git has no stored copy" in capsys.readouterr().out


def test_lab_copy_keeps_the_learners_copy_and_says_when_its_lesson_changed(tmp_path, capsys):
    (tmp_path / "notebooks").mkdir()
    (tmp_path / "pyproject.toml").write_text('[tool.jupytext]\nformats = "ipynb,py:percent"\n')  # the course's
    lesson = _lesson(tmp_path / "notebooks")
    lab = tmp_path / "lab"
    assert nbtool.lab_copy(lab, [lesson]) == 0
    copy = lab / lesson.name
    assert sorted(p.name for p in lab.iterdir()) == [".jupytext.toml", lesson.name]  # no .py pair
    assert "jupytext" not in nbformat.read(copy, as_version=4).metadata
    from jupytext.config import find_jupytext_configuration_file, load_jupytext_configuration_file

    found = find_jupytext_configuration_file(str(lab))  # what jupytext pairs a copy with: nothing
    assert found == str(lab / ".jupytext.toml") and load_jupytext_configuration_file(found).formats == ["ipynb"]
    assert find_jupytext_configuration_file(str(lesson.parent)) == str(tmp_path / "pyproject.toml")
    _save_a_run(copy)
    mine = copy.read_text()
    assert nbtool.lab_copy(lab, [lesson]) == 0 and copy.read_text() == mine  # a run in the copy stays
    assert "changed since you copied it" not in capsys.readouterr().out
    nb = nbformat.read(lesson, as_version=4)
    nb.cells[0].source = "# x, revised"
    nbformat.write(nb, lesson)
    assert nbtool.lab_copy(lab, [lesson]) == 0 and copy.read_text() == mine
    assert f"{copy}: the lesson changed since you copied it" in capsys.readouterr().out
    assert nbtool.lab_copy(lesson.parent, [lesson]) == 0  # LAB_DIR=notebooks: nothing copied
    assert sorted(p.name for p in lesson.parent.iterdir()) == ["03_x.ipynb", "03_x.py"]
