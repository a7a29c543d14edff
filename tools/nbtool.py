"""Notebook upkeep for the course (used by the Makefile, not by the lessons).

    python tools/nbtool.py execute notebooks/01_number_formats.ipynb ...
        sync each .py/.ipynb pair (the newer side wins), run the notebook top to bottom in
        a fresh kernel, store its outputs, and write the .py pair again.
    python tools/nbtool.py check-pairs notebooks/*.ipynb
        fail when a notebook's code or prose differs from its jupytext .py pair.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
import time
from pathlib import Path

import jupytext
import nbformat
from nbconvert.preprocessors import ExecutePreprocessor

FMT = "py:percent"


def _pair(nb_path: Path) -> Path:
    return nb_path.with_suffix(".py")


def sync(nb_path: Path) -> None:
    """Bring the .ipynb up to date with a newer .py pair (keeping stored outputs)."""
    py = _pair(nb_path)
    if py.exists() and (not nb_path.exists() or py.stat().st_mtime > nb_path.stat().st_mtime):
        text_nb = jupytext.read(py, fmt=FMT)
        if nb_path.exists():
            old = nbformat.read(nb_path, as_version=4)
            text_nb = jupytext.combine.combine_inputs_with_outputs(text_nb, old, fmt=FMT)
        _ensure_kernelspec(text_nb)
        nbformat.write(text_nb, nb_path)


def _ensure_kernelspec(nb) -> None:
    nb.metadata["kernelspec"] = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}
    nb.metadata.setdefault("language_info", {"name": "python"})
    nb.metadata["jupytext"] = {"formats": "ipynb,py:percent"}


def _check_expected_errors(nb, nb_path: Path) -> None:
    """A cell that fails on purpose wraps its code in ``amp_lessons.show.expect_error``, so
    the lesson runs without an error in every frontend. The ``raises-exception`` tag and
    nbval's NBVAL_RAISES_EXCEPTION comment are refused: they are conventions of JupyterLab
    and nbval that not every frontend follows (Colab does not document them)."""
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        if "NBVAL_RAISES_EXCEPTION" in cell.source or "raises-exception" in cell.metadata.get("tags", []):
            raise SystemExit(f"{nb_path}: a cell raises on purpose; wrap its code in "
                             "`with expect_error(...)` (amp_lessons.show) instead of tagging it")


def execute(nb_path: Path, timeout: int = 600) -> float:
    """Run one notebook in a fresh kernel from its own folder; return seconds taken."""
    sync(nb_path)
    nb = nbformat.read(nb_path, as_version=4)
    _ensure_kernelspec(nb)
    _check_expected_errors(nb, nb_path)
    for cell in nb.cells:  # no per-cell timestamps: they would make every re-run a diff
        cell.metadata.pop("execution", None)
    start = time.perf_counter()
    ExecutePreprocessor(timeout=timeout, kernel_name="python3", record_timing=False).preprocess(
        nb, {"metadata": {"path": str(nb_path.parent)}}
    )
    seconds = time.perf_counter() - start
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = merged_streams(cell.outputs)
    nb = stable_widget_ids(nb, nb_path.stem)
    nbformat.write(nb, nb_path)
    jupytext.write(nb, _pair(nb_path), fmt=FMT)
    return seconds


def merged_streams(outputs: list) -> list:
    """Consecutive stdout (or stderr) outputs joined into one: how the kernel chunks a
    cell's prints depends on timing, and the stored file should not."""
    merged = []
    for out in outputs:
        prev = merged[-1] if merged else None
        if (out.get("output_type") == "stream" and prev is not None
                and prev.get("output_type") == "stream" and prev.get("name") == out.get("name")):
            prev["text"] = prev["text"] + out["text"]
        else:
            merged.append(out)
    return merged


WIDGET_ID = re.compile(r"[0-9a-f]{32}")


def stable_widget_ids(nb, name: str):
    """The notebook with every widget model id replaced by one derived from the lesson's name
    and the model's place in the notebook. ipywidgets draws random ids on every run, so without
    this each re-execution rewrote the stored widget state (diff noise); with it the stored
    state changes only when the widgets do, and still renders the views offline.

    Order: the views in output order, then the models each one references (depth first, in
    the order its state names them), then any other model by its content."""
    state = nb.metadata.get("widgets", {}).get("application/vnd.jupyter.widget-state+json", {})
    models = state.get("state", {})
    order: list[str] = []

    def visit(model_id):
        if model_id in order:
            return
        order.append(model_id)
        for ref in re.findall(r"IPY_MODEL_([0-9a-f]{32})", json.dumps(models.get(model_id, {}), sort_keys=True)):
            visit(ref)

    for cell in nb.cells:
        for out in cell.get("outputs", []):
            view = out.get("data", {}).get("application/vnd.jupyter.widget-view+json")
            if view:
                visit(view["model_id"])
    for model_id in sorted(set(models) - set(order), key=lambda m: json.dumps(models[m], sort_keys=True)):
        visit(model_id)
    mapping = {old: hashlib.md5(f"{name}:{i}".encode()).hexdigest() for i, old in enumerate(order)}
    text = WIDGET_ID.sub(lambda m: mapping.get(m.group(0), m.group(0)), json.dumps(nb))
    return nbformat.from_dict(json.loads(text))


def _inputs(nb) -> list[tuple[str, str]]:
    return [(c.cell_type, c.source.strip()) for c in nb.cells]


def check_pairs(paths: list[Path]) -> int:
    bad = 0
    for nb_path in paths:
        py = _pair(nb_path)
        if not py.exists():
            print(f"{nb_path}: no jupytext pair {py.name}; run `make notebooks`")
            bad += 1
            continue
        if _inputs(nbformat.read(nb_path, as_version=4)) != _inputs(jupytext.read(py, fmt=FMT)):
            print(f"{nb_path}: differs from {py.name}; run `make notebooks` (or jupytext --sync)")
            bad += 1
    print(f"{len(paths) - bad} pairs in sync, {bad} out of sync")
    return 1 if bad else 0


def main(argv: list[str]) -> int:
    if len(argv) < 1 or argv[0] not in ("execute", "check-pairs"):
        print(__doc__)
        return 2
    paths = [Path(p) for p in argv[1:]]
    if argv[0] == "check-pairs":
        return check_pairs(paths)
    for p in paths:
        print(f"{p}: executed in {execute(p):.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
