"""Notebook upkeep for the course (used by the Makefile, not by the lessons).

    python tools/nbtool.py execute notebooks/01_number_formats.ipynb ...
        sync each .py/.ipynb pair (the newer side wins), run the notebook top to bottom in
        a fresh kernel, store its outputs, and write the .py pair again.
    python tools/nbtool.py check-pairs notebooks/*.ipynb
        fail when a notebook's code or prose differs from its jupytext .py pair, or when its
        outputs are not the ones `execute` stored (a run in JupyterLab saved over them).
    python tools/nbtool.py reset notebooks/*.ipynb
        put back the stored outputs (from git's HEAD) of each notebook a run saved over;
        a notebook whose code or prose was edited is left alone, saying so.
    python tools/nbtool.py stamp notebooks/*.ipynb
        record a notebook's outputs as its stored ones: for outputs `execute` made elsewhere
        (another checkout, a merge), never for a run in JupyterLab.
    python tools/nbtool.py lab-copy lab notebooks/*.ipynb
        copy each lesson missing from the working folder ``lab`` (make lab opens that
        folder), without the jupytext pairing; say which copies are older than their lesson.
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
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
    stamp(nb)
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


def _digest(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()


def outputs_digest(nb) -> str:
    """A digest of every code cell's outputs and the widget state they show."""
    outputs = [c.get("outputs", []) for c in nb.cells if c.cell_type == "code"]
    return _digest([outputs, nb.metadata.get("widgets", {})])


def stamp(nb) -> None:
    """Record ``nb``'s outputs as its stored ones (``metadata.amp_lessons.outputs``)."""
    nb.metadata.setdefault("amp_lessons", {})["outputs"] = outputs_digest(nb)


def outputs_state(nb) -> str:
    """``"stored"``: the outputs are the ones `execute` stored; ``"run"``: something else saved
    over them (a run in JupyterLab, a cleared notebook); ``"unstamped"``: no record."""
    recorded = nb.metadata.get("amp_lessons", {}).get("outputs")
    if recorded is None:
        return "unstamped"
    return "stored" if recorded == outputs_digest(nb) else "run"


def check_pairs(paths: list[Path]) -> int:
    """The .ipynb and .py of each lesson have the same code and prose, and the .ipynb holds
    the outputs `execute` stored: nbval compares a lesson's run with those, so a learner's
    run saved over them would be compared with itself."""
    bad = ran = 0
    for nb_path in paths:
        py = _pair(nb_path)
        if not py.exists():
            print(f"{nb_path}: no jupytext pair {py.name}; run `make notebooks`")
            bad += 1
            continue
        nb = nbformat.read(nb_path, as_version=4)
        if _inputs(nb) != _inputs(jupytext.read(py, fmt=FMT)):
            print(f"{nb_path}: differs from {py.name}; run `make notebooks` (or jupytext --sync)")
            bad += 1
        state = outputs_state(nb)
        if state != "stored":
            what = ("its outputs were saved by a run (in JupyterLab, or cleared), not stored by "
                    "`make notebooks`" if state == "run" else "it has no record of its stored outputs")
            print(f"{nb_path}: {what}. `make reset` puts the stored outputs back (when its code and "
                  f"prose are unchanged); `make notebooks NB={nb_path}` stores a fresh run")
            ran += 1
    print(f"{len(paths) - bad} pairs in sync, {bad} out of sync; "
          f"{len(paths) - ran} with their stored outputs, {ran} without")
    return 1 if bad or ran else 0


def _git_head_version(path: Path):
    """The notebook at ``path`` as git's HEAD has it, or a sentence saying why there is none."""
    try:
        shown = subprocess.run(["git", "show", f"HEAD:./{path.name}"], cwd=path.parent,
                               capture_output=True, text=True)
    except FileNotFoundError:
        return "git is not installed"
    if shown.returncode:
        return f"git has no stored copy ({shown.stderr.strip().splitlines()[-1] if shown.stderr.strip() else 'not a clone'})"
    return nbformat.reads(shown.stdout, as_version=4)


def reset(paths: list[Path]) -> int:
    """Put back the stored outputs of each notebook whose outputs a run saved over, from git's
    HEAD, when its code and prose are HEAD's; leave an edited notebook alone, saying so."""
    failed = done = 0
    for nb_path in paths:
        nb = nbformat.read(nb_path, as_version=4)
        if outputs_state(nb) == "stored":
            continue
        head = _git_head_version(nb_path)
        if isinstance(head, str):
            print(f"{nb_path}: not reset: {head}; download the lesson again to get its stored outputs")
            failed += 1
        elif _inputs(head) != _inputs(nb):
            print(f"{nb_path}: not reset: its code or prose was edited (`git diff {nb_path}` shows how); "
                  f"`git checkout -- {nb_path} {_pair(nb_path)}` drops the edit")
            failed += 1
        else:
            nbformat.write(head, nb_path)
            print(f"{nb_path}: stored outputs put back")
            done += 1
    print(f"{done} put back, {failed} left as they are, {len(paths) - done - failed} already held their stored outputs")
    return 1 if failed else 0


COPIED_FROM = "copied_from"  # a lab copy's record of the lesson's code and prose when copied
# In the working folder, jupytext pairs nothing: without this file it would take the pairing
# of the course's pyproject.toml and save a .py beside each copy. (A dotfile: the lab hides it.)
UNPAIRED = ("# The lessons' working copies (make lab): saved as .ipynb only, no .py pairs.\n"
            'formats = "ipynb"\n')


def lab_copy(lab_dir: Path, paths: list[Path]) -> int:
    """Copy each lesson missing from ``lab_dir`` there, without its jupytext pairing (so the
    lab lists it once and saves no .py: see :data:`UNPAIRED`); say which copies predate a
    change to their lesson."""
    if paths and lab_dir.resolve() == paths[0].parent.resolve():
        print(f"opening the stored lessons in {lab_dir} themselves: a run saved there changes them "
              "(`make reset` puts their stored outputs back)")
        return 0
    lab_dir.mkdir(parents=True, exist_ok=True)
    if not (lab_dir / ".jupytext.toml").exists():
        (lab_dir / ".jupytext.toml").write_text(UNPAIRED)
    copied, stale = [], []
    for nb_path in paths:
        lesson = nbformat.read(nb_path, as_version=4)
        digest = _digest(_inputs(lesson))
        dest = lab_dir / nb_path.name
        if dest.exists():
            mine = nbformat.read(dest, as_version=4)
            if mine.metadata.get("amp_lessons", {}).get(COPIED_FROM) != digest:
                stale.append(dest)
            continue
        lesson.metadata.pop("jupytext", None)
        lesson.metadata["amp_lessons"] = {COPIED_FROM: digest}
        nbformat.write(lesson, dest)
        copied.append(dest.name)
    if copied:
        print(f"copied {len(copied)} lesson(s) into {lab_dir}/, your working copy: {', '.join(copied)}")
    for dest in stale:
        print(f"{dest}: the lesson changed since you copied it; to take the new one, delete "
              f"{dest} (your runs and notes in it go) and run make lab again")
    return 0


def main(argv: list[str]) -> int:
    commands = ("execute", "check-pairs", "reset", "stamp", "lab-copy")
    if len(argv) < 1 or argv[0] not in commands or (argv[0] == "lab-copy" and len(argv) < 2):
        print(__doc__)
        return 2
    if argv[0] == "lab-copy":
        return lab_copy(Path(argv[1]), [Path(p) for p in argv[2:]])
    paths = [Path(p) for p in argv[1:]]
    if argv[0] == "check-pairs":
        return check_pairs(paths)
    if argv[0] == "reset":
        return reset(paths)
    if argv[0] == "stamp":
        for p in paths:
            nb = nbformat.read(p, as_version=4)
            stamp(nb)
            nbformat.write(nb, p)
            print(f"{p}: its outputs recorded as the stored ones")
        return 0
    for p in paths:
        print(f"{p}: executed in {execute(p):.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
