"""The loop checker (amp_lessons.lint): silent on correct loops, exactly one finding per
planted mistake, each at its line, and clear errors on what it cannot read."""

import ast
import inspect
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from amp_lessons import clipping, errors, exercises, training
from amp_lessons.__main__ import main
from amp_lessons.lint import CHECKS, RULES, LintError, check_loop, listing

ROOT = Path(__file__).resolve().parents[1]


def card_recipe() -> str:
    """The card's example, from the cell of lesson 02 that runs it."""
    text = (ROOT / "notebooks" / "02_autocast.py").read_text(encoding="utf-8")
    cell = next(c for c in text.split("# %%") if "noqa: F811  (the card's example)" in c and "import torch" in c)
    return cell.split("\n", 1)[1]


def line_of(source: str, needle: str) -> int:
    """The 1-based line of ``source`` holding ``needle`` (exactly one)."""
    hits = [i for i, line in enumerate(source.splitlines(), 1) if needle in line]
    assert len(hits) == 1, (needle, hits)
    return hits[0]


# --- correct loops ----------------------------------------------------------------------------

SCALED_NAME_STEP = """
scaled = scaler.scale(loss)          # lesson 03's cell: the scaled loss by name
scaled.backward()
scaler.unscale_(opt)
torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
scaler.step(opt)
scaler.update()
"""

MODULO_ACCUMULATION = """
def train(model, opt, scaler, scheduler, loader, accum_steps, device):
    for i, (x, y) in enumerate(loader):
        with torch.autocast(device.type, dtype=torch.float16):
            loss = loss_fn(model(x), y)
            loss = loss / accum_steps
        scaler.scale(loss).backward()
        if (i + 1) % accum_steps == 0:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scale_before = scaler.get_scale()
            scaler.step(opt)
            scaler.update()
            optimizer_was_run = scale_before <= scaler.get_scale()
            if optimizer_was_run:
                scheduler.step()
            opt.zero_grad(set_to_none=True)
"""

PER_OPTIMIZER_UNSCALE = """
def step(models, opts, scaler, x, y):
    with torch.autocast("cuda", dtype=torch.float16):
        loss = sum(loss_fn(m(x), y) for m in models)
    scaler.scale(loss).backward()
    for model, opt in zip(models, opts):
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
    scaler.update()
"""

EARLY_RETURN_GUARD = """
def my_step(model, opt, scaler, scheduler, x, y):
    with torch.autocast(x.device.type, dtype=torch.float16):
        loss = torch.nn.functional.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    scale = scaler.get_scale()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad(set_to_none=True)
    if scaler.get_scale() < scale:
        return True
    scheduler.step()
    return False
"""

EPOCH_SCHEDULER = """
for epoch in range(epochs):
    for x, y in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            loss = loss_fn(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
    lr_scheduler.step()  # once per epoch: a skipped step inside does not shift it
"""

BF16_NO_SCALER = """
from torch.amp import GradScaler
scaler = GradScaler("cuda", enabled=False)
for x, y in loader:
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = loss_fn(model(x), y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    sched.step()
    opt.zero_grad()
"""

SEVERAL_LOSSES = """
for x, y in loader:
    with torch.autocast("cuda", dtype=torch.float16):
        out = model(x)
        losses = [loss_fn(out, y), aux_fn(out)]
    for loss in losses:
        scaler.scale(loss).backward(retain_graph=True)
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
"""

NANOGPT_STEP = """
scaler = torch.amp.GradScaler("cuda", enabled=(dtype == "float16"))
while True:
    for param_group in optimizer.param_groups:
        param_group["lr"] = get_lr(iter_num)
    for micro_step in range(gradient_accumulation_steps):
        with ctx:
            logits, loss = model(X, Y)
            loss = loss / gradient_accumulation_steps
        X, Y = get_batch("train")
        scaler.scale(loss).backward()
    if grad_clip != 0.0:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    iter_num += 1
"""


def exercise_solution(models, optimizers, schedulers, batches):
    scaler = torch.amp.GradScaler("cpu")
    ran = set()
    for opt in optimizers:
        opt.register_step_post_hook(lambda opt, args, kwargs: ran.add(opt))
    for x, y in batches:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = sum(torch.nn.functional.cross_entropy(m(x), y) for m in models)
        scaler.scale(loss).backward()
        ran.clear()
        for opt in optimizers:
            scaler.step(opt)
        scaler.update()
        for opt, scheduler in zip(optimizers, schedulers):
            if opt in ran:  # its own step ran
                scheduler.step()
            opt.zero_grad(set_to_none=True)


HOOK_FUNCTION_GUARD = """
def train(models, opts, scheds, loader, scaler):
    took = {}

    def note(optimizer, args, kwargs):
        took[optimizer] = True

    for opt in opts:
        opt.register_step_post_hook(note)
    for x, y in loader:
        scaler.scale(sum(m(x).sum() for m in models)).backward()
        took.clear()
        for opt in opts:
            scaler.step(opt)
        scaler.update()
        for i, s in enumerate(scheds):
            if took.get(opts[i]):
                s.step()
"""

STATE_STEP_GUARD = """
def train(models, opts, scheds, loader, scaler):
    for x, y in loader:
        scaler.scale(sum(m(x).sum() for m in models)).backward()
        before = [[s["step"].item() for s in o.state.values()] for o in opts]
        for opt in opts:
            scaler.step(opt)
        scaler.update()
        for opt, sched, old in zip(opts, scheds, before):
            if [s["step"].item() for s in opt.state.values()] != old:  # its own step ran
                sched.step()
"""

TWO_HALVES_IN_TURN = """
for x, y in loader:
    scaler.scale(loss_d(x)).backward()
    scaler.step(opt_d)
    scaler.update()
    scaler.scale(loss_g(x)).backward()
    scaler.step(opt_g)
    scaler.update()
"""

TWO_STEPS_ONE_UPDATE = """
for x, y in loader:
    scaler.scale(loss(x)).backward()
    scaler.step(opts[0])
    scaler.step(opts[1])
    scaler.update()
"""

ONE_SCALER_PER_OPTIMIZER = """
for x, y in loader:
    for model, opt, scaler in zip(models, opts, scalers):
        scaler.scale(model(x).sum()).backward()
        scaler.step(opt)
        scaler.update()
"""

TWO_SCALERS_WRITTEN_OUT = """
for x, y in loader:
    scaler1.scale(loss1(x)).backward()
    scaler2.scale(loss2(x)).backward()
    scaler1.step(opt1)
    scaler1.update()
    scaler2.step(opt2)
    scaler2.update()
"""


import torch  # noqa: E402  (the solution above uses it; kept next to it for reading)

CORRECT = {
    "the card's recipe (lesson 02)": card_recipe,
    "clipping.accumulate": lambda: clipping.accumulate,
    "exercises.fixed_clipping_loop (lesson 04)": lambda: exercises.fixed_clipping_loop,
    "Trainer._forward_backward": lambda: training.Trainer._forward_backward,
    "errors: scheduler after real steps": lambda: errors.train_stepping_scheduler_after_real_steps,
    "errors: two optimizers, one update": lambda: errors.step_two_optimizers,
    "errors: the recipe in a loop": lambda: errors.train_recipe,
    "errors: head inside autocast": lambda: errors.head_inside_autocast,
    "errors: gradient penalty": lambda: errors.penalty_step,
    "lesson 03's scaled-by-name step": lambda: SCALED_NAME_STEP,
    "accumulation with % and a division": lambda: MODULO_ACCUMULATION,
    "unscale_ per optimizer, one update": lambda: PER_OPTIMIZER_UNSCALE,
    "scheduler guarded by an early return": lambda: EARLY_RETURN_GUARD,
    "scheduler stepped per epoch": lambda: EPOCH_SCHEDULER,
    "bf16 without a scaler": lambda: BF16_NO_SCALER,
    "several losses, one step": lambda: SEVERAL_LOSSES,
    "nanoGPT's loop, torch.amp spelling": lambda: NANOGPT_STEP,
    "06's exercise, solved": lambda: exercise_solution,
    "schedulers guarded by a step hook function": lambda: HOOK_FUNCTION_GUARD,
    "schedulers guarded by the optimizers' step counts": lambda: STATE_STEP_GUARD,
    "two models in turn, a backward and an update each": lambda: TWO_HALVES_IN_TURN,
    "two scaler.step calls written out, one update": lambda: TWO_STEPS_ONE_UPDATE,
    "a scaler per optimizer, zipped with it": lambda: ONE_SCALER_PER_OPTIMIZER,
    "two scalers written out, an update each": lambda: TWO_SCALERS_WRITTEN_OUT,
}


@pytest.mark.parametrize("name", list(CORRECT))
def test_correct_loops_have_no_findings(name):
    findings = check_loop(CORRECT[name]())
    assert not findings, str(findings)


def test_trainer_step_only_flags_its_teaching_branch():
    """Trainer.step clips before unscale_ on purpose when clip_order="before_unscale"
    (lesson 04's trap, teaching=True only): that branch, and nothing else, is a finding
    (none once the line carries an ``# amp-lint: ignore`` comment)."""
    lines, first = inspect.getsourcelines(training.Trainer)
    tree = ast.parse(textwrap.dedent("".join(lines)))
    (branch,) = [n for n in ast.walk(tree) if isinstance(n, ast.If)
                 and "before_unscale" in ast.unparse(n.test) and "self.clip_norm" in ast.unparse(n.test)]
    inside = range(branch.body[0].lineno + first - 1, branch.body[-1].end_lineno + first)
    findings = check_loop(training.Trainer)
    assert all(f.code == "clip-before-unscale" and f.line in inside for f in findings), str(findings)
    assert all("clip_grad_norm_" in lines[f.line - first] for f in findings)
    assert len(findings) <= 1


# --- broken loops: exactly their finding ------------------------------------------------------

DEPRECATED_AUTOCAST = """
for x, y in loader:
    with torch.cuda.amp.autocast():
        loss = loss_fn(model(x), y)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
"""

DEPRECATED_IMPORT = """
from torch.cuda.amp import GradScaler
scaler = GradScaler()
"""

NO_DEVICE = """
scaler = torch.amp.GradScaler(enabled=True)
"""

CLIP_FIRST = """
for x, y in loader:
    with torch.autocast("cuda", dtype=torch.float16):
        loss = loss_fn(model(x), y)
    scaler.scale(loss).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
"""

CLIP_NEVER_UNSCALED = """
def step(model, opt, scaler, x, y):
    with torch.autocast("cuda", dtype=torch.float16):
        loss = loss_fn(model(x), y)
    scaler.scale(loss).backward()
    torch.nn.utils.clip_grad_value_(model.parameters(), 0.1)
    scaler.step(opt)
    scaler.update()
"""

BACKWARD_INSIDE = """
for x, y in loader:
    with torch.autocast("cuda", dtype=torch.float16):
        loss = loss_fn(model(x), y)
        scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
"""

MODULO_UNDIVIDED = """
for i, (x, y) in enumerate(loader):
    with torch.autocast("cuda", dtype=torch.float16):
        loss = loss_fn(model(x), y)
    scaler.scale(loss).backward()
    if (i + 1) % accum_steps == 0:
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
"""

SCHEDULERS_IN_A_LOOP = """
for x, y in loader:
    scaler.scale(loss_fn(model(x), y)).backward()
    scaler.step(opt)
    scaler.update()
    for s in schedulers:
        s.step()
"""

SCHEDULERS_ENUMERATED = """
for x, y in loader:
    scaler.scale(loss_fn(model(x), y)).backward()
    scaler.step(opt)
    scaler.update()
    for i, s in enumerate(self.lr_schedulers):
        s.step()
"""

SCHEDULER_AFTER_A_LOOP_OF_STEPS = """
for x, y in loader:
    scaler.scale(sum(loss_fn(m(x), y) for m in models)).backward()
    for opt in optimizers:
        scaler.step(opt)
    scaler.update()
    scheduler.step()
"""

HOOK_THAT_WRITES_ELSEWHERE = """
ran = set()
opt.register_step_post_hook(lambda o, *_: ran.add(o))
for x, y in loader:
    scaler.scale(loss_fn(model(x), y)).backward()
    scaler.step(opt)
    scaler.update()
    if self.log_every:
        scheduler.step()
"""

UPDATE_IN_A_ZIP_OF_OPTIMIZERS = """
for x, y in loader:
    scaler.scale(loss(x)).backward()
    for opt, sched in zip(opts, scheds):
        scaler.step(opt)
        scaler.update()
"""

UPDATE_BETWEEN_STEPS = """
for x, y in loader:
    scaler.scale(loss(x)).backward()
    scaler.step(opts[0])
    scaler.update()
    scaler.step(opts[1])
"""

BATCH_STEP_FIELD = """
for batch in loader:
    scaler.scale(loss(batch)).backward()
    scaler.step(opt)
    scaler.update()
    if batch["step"] % 10 == 0:
        scheduler.step()
"""

GUARD_THROUGH_A_HELPER = """
def count(o):
    return max((int(s["step"]) for s in o.state.values()), default=0)

for x, y in loader:
    scaler.scale(loss_fn(model(x), y)).backward()
    before = [count(o) for o in optimizers]
    for opt in optimizers:
        scaler.step(opt)
    scaler.update()
    for opt, sched, b in zip(optimizers, schedulers, before):
        if count(opt) > b:
            sched.step()
"""

GUARD_ON_FOUND_INF = """
for x, y in loader:
    scaler.scale(loss_fn(model(x), y)).backward()
    for opt, sched in zip(optimizers, schedulers):
        scaler.step(opt)
        if not any(v.item() for v in scaler._found_inf_per_device(opt).values()):
            sched.step()
    scaler.update()
"""

HALF_MODEL = """
model = Net().cuda().half()
opt = torch.optim.Adam(model.parameters())
scaler = torch.amp.GradScaler("cuda")
"""

BROKEN = {  # name: (loop, the one finding it must have)
    "torch.cuda.amp.autocast": (lambda: DEPRECATED_AUTOCAST, "deprecated-amp"),
    "from torch.cuda.amp import GradScaler": (lambda: DEPRECATED_IMPORT, "deprecated-amp"),
    "GradScaler(enabled=True)": (lambda: NO_DEVICE, "scaler-no-device"),
    "clip, then unscale_": (lambda: CLIP_FIRST, "clip-before-unscale"),
    "clip, never unscaled": (lambda: CLIP_NEVER_UNSCALED, "clip-before-unscale"),
    "errors: unscale_ every micro-batch": (lambda: errors.accumulate_unscaling_every_micro_batch, "unscale-twice"),
    "errors: scheduler always steps": (lambda: errors.train_stepping_scheduler_always, "scheduler-unguarded"),
    "lesson 03's exercise as given": (lambda: exercises.amp_step_as_given, "scheduler-unguarded"),
    "errors: model.half() with a scaler": (lambda: errors.train_half_model, "half-with-scaler"),
    "Net().cuda().half()": (lambda: HALF_MODEL, "half-with-scaler"),
    "lesson 05's exercise as given": (lambda: exercises.broken_setup, "half-with-scaler"),
    "backward inside autocast": (lambda: BACKWARD_INSIDE, "backward-in-autocast"),
    "schedulers stepped in a loop": (lambda: SCHEDULERS_IN_A_LOOP, "scheduler-unguarded"),
    "schedulers stepped in an enumerate loop": (lambda: SCHEDULERS_ENUMERATED, "scheduler-unguarded"),
    "a scheduler after a loop of scaler.step": (lambda: SCHEDULER_AFTER_A_LOOP_OF_STEPS, "scheduler-unguarded"),
    "an if that reads no name the step hook writes": (lambda: HOOK_THAT_WRITES_ELSEWHERE, "scheduler-unguarded"),
    "errors: update per optimizer": (lambda: errors.step_two_optimizers_updating_each, "update-per-optimizer"),
    "update between two scaler.step calls written out": (lambda: UPDATE_BETWEEN_STEPS, "update-per-optimizer"),
    "one scaler updated in a zip over (opt, sched)": (lambda: UPDATE_IN_A_ZIP_OF_OPTIMIZERS, "update-per-optimizer"),
    "a scheduler guarded by a batch's 'step' field": (lambda: BATCH_STEP_FIELD, "scheduler-unguarded"),
    "a step-count guard through a helper: 'may'": (lambda: GUARD_THROUGH_A_HELPER, "scheduler-guard-unread"),
    "clipping: loss not divided": (lambda: clipping.accumulate_without_dividing, "accumulation-undivided"),
    "accumulation with %, not divided": (lambda: MODULO_UNDIVIDED, "accumulation-undivided"),
    "clipping: step every micro-batch": (lambda: clipping.accumulate_stepping_every_micro_batch,
                                         "step-per-micro-batch"),
}


@pytest.mark.parametrize("name", list(BROKEN))
def test_each_broken_loop_has_exactly_its_finding(name):
    make, code = BROKEN[name]
    findings = check_loop(make())
    assert findings.codes == [code], str(findings)
    f = findings[0]
    assert f.lesson == CHECKS[code] and f.message and f.line > 0


def test_a_guard_the_checker_cannot_read_is_a_note_and_a_bare_step_stays_a_mistake():
    unread = check_loop(GUARD_THROUGH_A_HELPER)
    assert [f.kind for f in unread] == ["note"] and "may" in unread[0].message
    bare = GUARD_THROUGH_A_HELPER.replace("        if count(opt) > b:\n            sched.step()",
                                          "        sched.step()")
    assert bare != GUARD_THROUGH_A_HELPER
    assert [(f.code, f.kind) for f in check_loop(bare)] == [("scheduler-unguarded", "mistake")]
    config = GUARD_THROUGH_A_HELPER.replace("if count(opt) > b:", "if args.warmup(b):")
    assert check_loop(config).codes == ["scheduler-unguarded"]  # a call that takes no optimizer
    assert not check_loop(GUARD_ON_FOUND_INF)  # a call the checker reads: a guard, no "may"


def test_every_check_has_a_broken_loop():
    assert set(CHECKS) - {code for _, code in BROKEN.values()} <= {
        "scaler-cuda-only", "missing-update", "step-after-scaler-step", "fp16-without-scaler"}  # test_lint_rules


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.name)
def test_each_rule_example_has_its_finding_and_its_fix_none(rule):
    assert check_loop(rule.example).codes == [rule.name], str(check_loop(rule.example))
    assert not check_loop(rule.fix), str(check_loop(rule.fix))


def test_findings_point_at_the_mistaken_line():
    cases = [(CLIP_FIRST, "clip_grad_norm_"), (BACKWARD_INSIDE, ".backward()"),
             (NO_DEVICE, "GradScaler("), (DEPRECATED_AUTOCAST, "torch.cuda.amp"),
             (MODULO_UNDIVIDED, ".backward()"), (HALF_MODEL, ".half()")]
    for source, needle in cases:
        (f,) = check_loop(source)
        assert f.line == line_of(textwrap.dedent(source), needle), (f, needle)


def test_lesson04_exercise_loop_has_its_three_bugs_and_the_note():
    """04's broken loop: GradScaler() without a device, the clip before unscale_, and
    unscale_/step/update on every micro-batch; backward inside autocast is only a note
    (04 shows the gradients of its model are the same)."""
    source = inspect.getsource(exercises.broken_clipping_loop)
    findings = check_loop(source)
    expected = {
        ("scaler-no-device", line_of(source, "GradScaler()")),
        ("clip-before-unscale", line_of(source, "clip_grad_norm_")),
        ("step-per-micro-batch", line_of(source, "scaler.step(opt)")),
        ("backward-in-autocast", line_of(source, ".backward()")),
    }
    assert {(f.code, f.line) for f in findings} == expected
    assert [f.kind for f in findings if f.code == "backward-in-autocast"] == ["note"]


def test_lesson06_exercise_as_given_has_its_three_bugs():
    source = inspect.getsource(exercises.two_model_loop_as_given)
    assert {(f.code, f.line) for f in check_loop(source)} == {
        ("scaler-no-device", line_of(source, "GradScaler()")),
        ("update-per-optimizer", line_of(source, "scaler.update()")),
        ("scheduler-unguarded", line_of(source, "scheduler.step()")),
    }


def test_function_findings_use_the_file_lines():
    lines, first = inspect.getsourcelines(errors.step_two_optimizers_updating_each)
    (f,) = check_loop(errors.step_two_optimizers_updating_each)
    assert "scaler.update()" in lines[f.line - first]


def test_ignore_comments():
    quiet = CLIP_FIRST.replace("1.0)\n", "1.0)  # amp-lint: ignore[clip-before-unscale]\n")
    assert not check_loop(quiet)
    other = CLIP_FIRST.replace("1.0)\n", "1.0)  # amp-lint: ignore[scaler-no-device]\n")
    assert check_loop(other).codes == ["clip-before-unscale"]
    assert not check_loop(CLIP_FIRST.replace("1.0)\n", "1.0)  # amp-lint: ignore\n"))


def test_listing_numbers_lines_as_findings_do():
    source = inspect.getsource(exercises.broken_clipping_loop)
    numbered = listing(source).splitlines()
    for f in check_loop(source):
        assert numbered[f.line - 1].lstrip().startswith(f"{f.line}  ")


# --- what it cannot read ----------------------------------------------------------------------

CARD_AS_PASTED = """\
with torch.autocast(device_type=device, dtype=dtype):
logits = model(x) # matmuls in 16-bit
loss = nn.functional.cross_entropy(logits, y)
"""


def test_unparsable_source_names_the_line():
    with pytest.raises(LintError, match=r"cannot parse the source: expected an indented block.* at line 2"):
        check_loop(CARD_AS_PASTED)


def test_objects_without_source_are_refused_clearly():
    with pytest.raises(LintError, match="cannot read the source of .*pass the loop's source as a string"):
        check_loop(len)


# --- the command line -------------------------------------------------------------------------

EVERY_MISTAKE = '''\
import torch
from torch.cuda.amp import autocast


def train(model, opt, scheduler, loader, optimizers, accum_steps):
    model.half()
    scaler = torch.amp.GradScaler()
    for i, (x, y) in enumerate(loader):
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(x).sum()
            scaler.scale(loss).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        scheduler.step()
        opt.zero_grad()


def two(models, optimizers, scaler, x, y):
    loss = sum(m(x).sum() for m in models)
    scaler.scale(loss).backward()
    for opt in optimizers:
        scaler.step(opt)
        scaler.update()


def accumulate(model, opt, scaler, batches):
    for x, y in batches:
        loss = model(x).sum()
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()


def micro(model, opt, scaler, batches, k):
    for x, y in batches:
        loss = model(x).sum() / k
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    opt.zero_grad()
'''

EVERY_MISTAKE_LINES = {
    "deprecated-amp": 2, "half-with-scaler": 6, "scaler-no-device": 7, "backward-in-autocast": 11,
    "clip-before-unscale": 12, "scheduler-unguarded": 16, "update-per-optimizer": 25,
    "accumulation-undivided": 31, "unscale-twice": 32, "step-per-micro-batch": 41,
}


def test_cli_prints_one_finding_per_mistake(tmp_path, capsys):
    path = tmp_path / "train.py"
    path.write_text(EVERY_MISTAKE)
    assert main(["lint", str(path)]) == 1
    out = capsys.readouterr().out.strip().splitlines()
    found = [re.match(rf"{re.escape(str(path))}:(\d+): (mistake|note): \[([a-z-]+)\] .+ \(lesson \d\d_\w+\)$", line)
             for line in out]
    assert all(found), out
    assert {m.group(3): int(m.group(1)) for m in found} == EVERY_MISTAKE_LINES
    assert len(out) == len(EVERY_MISTAKE_LINES)


def test_cli_exit_codes(tmp_path, capsys):
    good = tmp_path / "good.py"
    good.write_text(card_recipe())
    assert main(["lint", str(good)]) == 0
    assert "no findings" in capsys.readouterr().out
    bad = tmp_path / "bad.py"
    bad.write_text(CARD_AS_PASTED)
    assert main(["lint", str(bad)]) == 2
    assert f"cannot parse {bad}: expected an indented block" in capsys.readouterr().err
    assert main(["lint", str(tmp_path / "missing.py")]) == 2
    assert "no such file" in capsys.readouterr().err
    notes = tmp_path / "notes.py"
    notes.write_text(BACKWARD_INSIDE)
    assert main(["lint", str(notes)]) == 0  # a note alone is not a mistake
    assert "note: [backward-in-autocast]" in capsys.readouterr().out


def test_python_dash_m_lint(tmp_path):
    path = tmp_path / "train.py"
    path.write_text(EVERY_MISTAKE)
    run = subprocess.run([sys.executable, "-m", "amp_lessons", "lint", str(path)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 1, run.stderr
    assert len(run.stdout.strip().splitlines()) == len(EVERY_MISTAKE_LINES)


def test_course_code_has_no_deprecated_amp_outside_its_marked_lines():
    """The course's own code, read by its own checker: no torch.cuda.amp / torch.cpu.amp in
    code (prose may name them), except the three lines of errors.py that make lesson 06's
    FutureWarnings on purpose, each marked ``# amp-lint: ignore[deprecated-amp]``."""
    files = [*ROOT.glob("src/**/*.py"), *ROOT.glob("notebooks/*.py"), *ROOT.glob("benchmarks/*.py")]
    offenders = [f"{f.relative_to(ROOT)}:{x.line}" for f in files for x in check_loop(f)
                 if x.code == "deprecated-amp"]
    assert not offenders
    marked = [f.relative_to(ROOT).as_posix() for f in files
              for line in f.read_text(encoding="utf-8").splitlines() if "amp-lint: ignore[deprecated-amp]" in line]
    assert marked == ["src/amp_lessons/errors.py"] * 3


def test_backward_in_autocast_note_names_where_the_gradients_may_differ():
    (note,) = [f for f in check_loop(BACKWARD_INSIDE) if f.code == "backward-in-autocast"]
    assert note.kind == "note"
    assert "autocast(enabled=False)" in note.message and "custom_fwd/custom_bwd" in note.message
    assert "may get 16-bit matmuls" in note.message and "On the CPU the gradients came out the same" in note.message
    assert "not measured on a GPU" in note.message


def test_scheduler_message_tells_several_optimizers_from_one():
    (finding,) = check_loop(SCHEDULER_AFTER_A_LOOP_OF_STEPS)
    assert "with one optimizer, when scaler.get_scale() did not drop" in finding.message
    assert "when its own optimizer stepped (optimizer.register_step_post_hook; a fused=True" in finding.message
    assert "may fire it too: with Adam, AdamW or Adagrad, compare state['step'] instead" in finding.message
    assert ("only when the first step is skipped, and never for a fused=True Adam, AdamW or SGD (Adagrad too "
            "in torch 2.13)") in finding.message


@pytest.mark.parametrize("name", ["Adam", "AdamW", "Adagrad", "SGD"])
def test_fused_optimizer_skips_as_the_scheduler_message_says(name):
    """What the message (and lesson 06, sections 1 and 3) says of fused=True: Adam, AdamW and SGD
    (Adagrad in torch 2.13, not 2.11) skip in their kernel, so no warning and the post-hook fires
    on skipped steps; Adam, AdamW and Adagrad keep a step count that skipped steps leave
    unchanged, SGD keeps none."""
    import warnings

    import torch

    model = torch.nn.Linear(4, 2)
    opt = getattr(torch.optim, name)(model.parameters(), lr=0.1, fused=True)
    sched, scaler, fired = torch.optim.lr_scheduler.StepLR(opt, 1), torch.amp.GradScaler("cpu"), []
    opt.register_step_post_hook(lambda *_: fired.append(1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for value in (float("inf"), float("inf"), 1.0):
            opt.zero_grad()
            scaler.scale(model(torch.full((1, 4), value)).sum()).backward()
            scaler.step(opt)
            scaler.update()
            sched.step()
    in_kernel = getattr(opt, "_step_supports_amp_scaling", False)
    release = tuple(int(n) for n in torch.__version__.split("+")[0].split(".")[:2])
    assert in_kernel == (name != "Adagrad" or release >= (2, 13)) or release == (2, 12)  # 2.12 unchecked
    assert bool([w for w in caught if "lr_scheduler.step()" in str(w.message)]) == (not in_kernel)
    assert len(fired) == (3 if in_kernel else 1)
    steps = [float(s["step"]) for s in opt.state.values() if "step" in s]
    assert steps == ([] if name == "SGD" else [1.0, 1.0])


def test_a_finding_prints_its_kind_as_the_command_line_does():
    found = check_loop(BACKWARD_INSIDE)
    (note,) = [f for f in found if f.code == "backward-in-autocast"]
    assert str(note).startswith(f"line {note.line}: note: [backward-in-autocast] ")
    assert all(str(f).startswith(f"{f.where}: {f.kind}: [{f.code}]") for f in found)


def test_half_with_scaler_message_says_which_call_raises():
    """The message: unscale_ refuses float16 gradients, and so does scaler.step, except with a
    fused optimizer that steps in its kernel (no unscale_ then: lesson 06, section 1's table)."""
    (finding,) = [f for f in check_loop(errors.train_half_model) if f.code == "half-with-scaler"]
    assert ("scaler.unscale_ raises 'Attempting to unscale FP16 gradients.' (so does scaler.step, "
            "except for a fused=True Adam, AdamW or SGD, and Adagrad in torch 2.13)") in finding.message

    def step(fused: bool, unscale_first: bool):
        model = torch.nn.Linear(4, 2).half()
        opt, scaler = torch.optim.SGD(model.parameters(), lr=0.1, fused=fused), torch.amp.GradScaler("cpu")
        scaler.scale(model(torch.ones(1, 4, dtype=torch.float16)).float().sum()).backward()
        if unscale_first:
            scaler.unscale_(opt)
        scaler.step(opt)

    for fused, unscale_first in ((False, False), (True, True)):
        with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients."):
            step(fused, unscale_first)
    step(fused=True, unscale_first=False)  # no error: the fused step never calls unscale_
