"""Mutation testing of the teaching modules: plant small bugs, count those the tests catch.

    python tools/mutants.py claims scaling clipping      # or: make mutants MUTANTS="claims scaling"

For each module ``M`` it runs mutmut (3.x, a dev dependency) in a scratch copy of the project,
``artifacts/mutants/M/``, mutating only ``src/amp_lessons/M.py`` and running only
``tests/test_M.py`` (the module's own tests: a bug only another module's tests would catch
counts as a survivor). Each mutant is one small change (a comparison, a constant, a dropped
argument); a mutant is *killed* when a test fails, *survived* when every test passes.

Prints, per module: killed, survived, timeout, the other outcomes, and the score
``killed / (killed + survived)``. A survivor listed in ``tools/mutants_equivalent.txt``
(``module.mutant_name  why``: a change that cannot alter behaviour) is counted apart as
*equivalent*, not as a survivor. ``--show`` prints every survivor's diff.

It takes long (minutes per module on one core) and is not part of ``make test``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRATCH = ROOT / "artifacts" / "mutants"
EQUIVALENT = Path(__file__).with_name("mutants_equivalent.txt")
PACKAGE = "amp_lessons"
# Tests left out of the mutation runs: each starts a Jupyter kernel (some 40 s a mutant) to
# check the sanitize rule, not the module's arithmetic, which the module's other tests cover.
DESELECT = {"claims": ["tests/test_claims.py::test_a_verdict_that_fails_makes_the_notebook_test_fail"]}
KILLED = ("killed", "caught by type check")
SURVIVED = ("survived",)


def checkout(rev: str | None) -> Path:
    """The project's files: this working tree, or (``rev``) those of a git revision, unpacked
    into ``artifacts/mutants/rev-<rev>`` (to score the tests as they were before a change)."""
    if rev is None:
        return ROOT
    out = SCRATCH / f"rev-{rev.replace('/', '_')}"
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", rev, "src", "tests", "notebooks/sanitize.cfg", "pyproject.toml"],
                             cwd=ROOT, check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(out)], input=archive, check=True)
    return out


def scratch_copy(module: str, base: Path = ROOT) -> Path:
    """``artifacts/mutants/<module>``: src, tests/conftest.py, the module's test file, and a
    pyproject whose only mutmut settings say which file to mutate and which tests to run."""
    tests = base / "tests" / f"test_{module}.py"
    source = base / "src" / PACKAGE / f"{module}.py"
    for path in (source, tests):
        if not path.exists():
            raise SystemExit(f"no {path.relative_to(base)}: name modules of src/{PACKAGE} that "
                             "have their own tests/test_<module>.py")
    work = SCRATCH / module
    if work.exists():
        shutil.rmtree(work)
    (work / "tests").mkdir(parents=True)
    shutil.copytree(base / "src", work / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    shutil.copy(base / "tests" / "conftest.py", work / "tests")
    shutil.copy(tests, work / "tests")
    (work / "notebooks").mkdir()
    shutil.copy(base / "notebooks" / "sanitize.cfg", work / "notebooks")  # the claims tests read it
    deselect = [arg for test in DESELECT.get(module, ()) for arg in ("--deselect", test)]
    pyproject = (base / "pyproject.toml").read_text(encoding="utf-8")
    pyproject = re.sub(r"(?ms)^\[tool\.mutmut\].*?(?=^\[|\Z)", "", pyproject)
    pyproject += (
        "\n[tool.mutmut]\n"
        'source_paths = ["src"]\n'
        f'only_mutate = ["src/{PACKAGE}/{module}.py"]\n'
        f'pytest_add_cli_args_test_selection = ["tests/test_{module}.py"]\n'
        f'pytest_add_cli_args = {json.dumps(["-p", "no:cacheprovider", "-q", "-x", *deselect])}\n'
        'also_copy = ["notebooks"]\n'
        "use_git_change_detection = false\n"
    )
    (work / "pyproject.toml").write_text(pyproject, encoding="utf-8")
    return work


def equivalent_names(module: str) -> dict[str, str]:
    """The survivors of ``module`` recorded as equivalent: ``{mutant name: why}``."""
    if not EQUIVALENT.exists():
        return {}
    out = {}
    for line in EQUIVALENT.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            name, _, why = line.partition(" ")
            if name.split(".", 2)[1] == module:
                out[name] = why.strip()
    return out


def run_module(module: str, python: str, show: bool, base: Path = ROOT, max_minutes: float = 15,
               count_only: bool = False) -> dict:
    """mutmut over one module (or, ``count_only``, the counts of its last run); its outcome counts."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "AMP_LESSONS_PROGRESS": "0", "MPLBACKEND": "Agg"}
    env.pop("PYTHONPATH", None)  # mutmut puts its mutated copy of src first itself
    started = time.monotonic()
    work = SCRATCH / module
    if not count_only:
        work = scratch_copy(module, base)
        run = subprocess.Popen(["nice", "-n", "19", python, "-m", "mutmut", "run", "--max-children", "1"],
                               cwd=work, env=env, stdout=subprocess.DEVNULL, start_new_session=True)
        try:
            run.wait(timeout=max_minutes * 60)
        except subprocess.TimeoutExpired:  # the mutants not run yet are counted as "not checked"
            os.killpg(run.pid, signal.SIGTERM)
            run.wait()
            print(f"{module}: stopped after {max_minutes:g} minutes", flush=True)
    elif not (work / "mutants").is_dir():
        raise SystemExit(f"no earlier run of {module} in {work.relative_to(ROOT)}: run without --count-only")
    minutes = (time.monotonic() - started) / 60
    listing = subprocess.run([python, "-m", "mutmut", "results", "--all", "true"], cwd=work, env=env,
                             check=True, capture_output=True, text=True).stdout
    statuses = dict(re.findall(r"^\s*(\S+): (.+?)\s*$", listing, flags=re.M))
    equivalent = equivalent_names(module)
    counts = {"killed": 0, "survived": 0, "equivalent": 0, "other": {}}
    survivors = []
    for name, status in statuses.items():
        if status in KILLED:
            counts["killed"] += 1
        elif status in SURVIVED and name in equivalent:
            counts["equivalent"] += 1
        elif status in SURVIVED:
            counts["survived"] += 1
            survivors.append(name)
        else:
            counts["other"][status] = counts["other"].get(status, 0) + 1
    judged = counts["killed"] + counts["survived"]
    other = ", ".join(f"{n} {s}" for s, n in sorted(counts["other"].items())) or "none"
    print(f"{module}: {counts['killed']} killed, {counts['survived']} survived, "
          f"{counts['equivalent']} equivalent; other: {other}; score "
          f"{counts['killed']}/{judged} = {counts['killed'] / max(1, judged):.0%} ({minutes:.1f} min)",
          flush=True)
    for name in survivors:
        print(f"  survived: {name}")
        if show:
            diff = subprocess.run([python, "-m", "mutmut", "show", name], cwd=work, env=env,
                                  capture_output=True, text=True).stdout
            print("    " + diff.strip().replace("\n", "\n    "))
    return counts


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("modules", nargs="+", help=f"modules of src/{PACKAGE}, e.g. claims scaling")
    parser.add_argument("--show", action="store_true", help="print each survivor's diff")
    parser.add_argument("--python", default=sys.executable, help="the Python that has mutmut")
    parser.add_argument("--max-minutes", type=float, default=15,
                        help="stop a module's run after this long (default 15); the rest count as not checked")
    parser.add_argument("--count-only", action="store_true",
                        help="count the outcomes of the last run again (after editing mutants_equivalent.txt)")
    parser.add_argument("--rev", default=None, help="score the code and tests of this git revision "
                        "(e.g. main) instead of the working tree")
    args = parser.parse_args(argv)
    base = ROOT if args.count_only else checkout(args.rev)
    for module in args.modules:
        run_module(module, args.python, args.show, base, args.max_minutes, args.count_only)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
