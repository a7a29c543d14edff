"""Checkers for the lessons' exercises: each runs or inspects the learner's answer and
returns a :class:`Verdict` that says what is right and what is still wrong.
"""

from __future__ import annotations

import bisect
import contextlib
import math
from dataclasses import dataclass, field

import torch

from .claims import measured
from .clipping import AmpCallLog, _Tracker, backward_inside_autocast_matches, record_amp_calls
from .clipping import lesson_model as clipping_lesson_model
from .data import digits
from .distributed import policy_label, policy_stages
from .errors import tiny_batches, tiny_model, without_cuda
from .formats import check_scale, format_info, scaled_census
from .hardware import pick_device
from .lint import LintError, check_loop
from .master import eps_in
from .models import mlp
from .precision import dtype_of, parse_precision
from .scaling import SCHEDULER_WARNING, lesson_data, optimizer_steps
from .scaling import lesson_model as scaling_lesson_model
from .trace import short


@dataclass
class Verdict:
    """The result of checking an exercise: ``passed`` plus one line per finding."""

    passed: bool
    findings: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        head = "correct" if self.passed else "not yet"
        return "\n".join([head, *("  - " + f for f in self.findings)])

    __repr__ = __str__


# --- 01_number_formats ---------------------------------------------------------------


def check_loss_scale(scale, grads, target: float = 0.99) -> Verdict:
    """01: is ``scale`` the smallest loss scale that leaves none of the nonzero ``grads``
    flushed to zero in fp16, at least ``target`` of them normal, and none overflowing? It
    must be a power of two, as GradScaler's are: multiplying by one changes only the
    exponent, so it rounds nothing.
    """
    import math

    if scale is None or (isinstance(scale, str) and scale.strip() in ("", "?")):
        return Verdict(False, ["no answer yet: set the scale to a power of two, e.g. 2.0**4"])
    try:
        scale = check_scale(scale)
    except ValueError as err:
        return Verdict(False, [str(err)])
    k = math.log2(scale)
    findings, passed = [], True
    if k != round(k):
        passed = False
        findings.append(f"{scale:.10g} (2^{k:.4g}) is not a power of two: multiplying by it can round each "
                        "gradient's mantissa; GradScaler's default scales are powers of two (2.0**k)")
    label = f"2^{k:.0f}" if k == round(k) else f"{scale:.10g}"
    c = scaled_census(grads, "fp16", scale)
    normal = c.fraction("normal")
    # The gradients come from a training run: their counts are figures from float kernels.
    findings.append(f"at {label}: {measured(normal, '.2%')} of the {measured(c.nonzero, ',')} nonzero "
                    f"gradients are normal in fp16 (the goal: at least {target:.0%}, none flushed); "
                    f"{measured(c.flushed, 'd')} flushed to zero, {measured(c.subnormal, 'd')} subnormal, "
                    f"{measured(c.overflow, 'd')} overflow")
    if c.overflow:
        passed = False
        findings.append(f"too large: {measured(c.overflow, 'd')} values overflow to inf, and one inf makes "
                        "GradScaler skip the whole step; try a smaller power of two")
    elif c.flushed or normal < target:
        passed = False
        lost = "some gradients still flush to zero" if c.flushed else "too many values are still subnormal"
        findings.append(f"too small: {lost}; try a larger power of two")
    elif passed and scale / 2 > 0:
        half = scaled_census(grads, "fp16", scale / 2)
        if half.flushed == 0 and half.fraction("normal") >= target:  # no overflow: fewer than at scale
            passed = False
            findings.append("half of it does too: find the smallest power of two that does")
    return Verdict(passed, findings)


# --- 02_autocast ---------------------------------------------------------------------


def dtype_exercise(device=None, seed: int = 0):
    """02's "predict the dtype" model: ``(model, x, target, loss_fn)`` on ``device``.

    Conv2d -> GroupNorm -> GELU -> Flatten -> Linear -> LogSoftmax on 8x8 one-channel
    images, NLL loss. Its answers differ between CPU and CUDA autocast (GroupNorm and
    log_softmax are on CUDA's float32 list, not on the CPU's), so the learner has to reason
    with this device's lists. Built under its own seed; the global RNG is left untouched.
    """
    import torch
    from torch import nn
    from torch.nn import functional as F

    dev = pick_device(device)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = nn.Sequential(
            nn.Conv2d(1, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.GELU(), nn.Flatten(),
            nn.Linear(8 * 8 * 8, 10), nn.LogSoftmax(dim=1),
        )
        x, target = torch.randn(16, 1, 8, 8), torch.randint(0, 10, (16,))
    return model.to(dev), x.to(dev), target.to(dev), F.nll_loss


_DTYPE_ANSWERS = "write 'fp32', 'bf16' or 'fp16'"


def _rule_hint(op: str, record, device: str) -> str:
    """The rule that decided ``record``'s dtype, as a question: a hint, not the answer. Rules 1
    and 2 share one hint (its number would name the op's list, and so the dtype)."""
    if record.rule in (1, 2):
        return (f"{op}: not yet. Autocast stepped in for this op (rule 1 or 2): which of "
                f"{device}'s two lists is it on? Look it up: the three rules name their ops, "
                "and the full lists are in aten/src/ATen/autocast_mode.h and autocast_mode.cpp.")
    hint = (f"{op}: not yet. Rule 3 decided this one: autocast had nothing to cast on {device} "
            "(the op is on no list, or its inputs had its list's dtype already), so it ran in "
            "the dtype its inputs gave it. Which dtype did the op before it produce?")
    if "norm" in op:
        hint += " (The lesson's cell with no autocast shows what a normalization's weight does.)"
    return hint


def _parse_guess(op: str, guess):
    """``(dtype, None)`` for a valid prediction, ``(None, finding)`` otherwise."""
    if guess is None or (isinstance(guess, str) and guess.strip() in ("", "?")):
        return None, f"{op}: no prediction yet ({_DTYPE_ANSWERS})"
    try:
        name = parse_precision(guess)
    except ValueError:
        return None, f"{op}: {guess!r} is not one of this exercise's answers; {_DTYPE_ANSWERS}"
    if name == "tf32":
        return None, (f"{op}: 'tf32' is not a dtype a tensor can have: TF32 is a mode of float32 "
                      "matmuls (NVIDIA GPUs from Ampere on; x86 CPUs with AMX-FP16, through oneDNN): "
                      "the tensors stay torch.float32, and autocast never "
                      f"picks it; {_DTYPE_ANSWERS}")
    return dtype_of(name), None


DTYPE_EXERCISE_OPS = ("convolution", "native_group_norm", "gelu", "_log_softmax",
                      "nll_loss_forward")  # the ops 02's exercise asks about


def check_dtype_predictions(predictions: dict, trace, reveal: bool = False,
                            ops=DTYPE_EXERCISE_OPS) -> Verdict:
    """02: compare ``{aten op: predicted dtype}`` with the dtypes a live trace recorded.

    A prediction is a precision name (``"bf16"``, ``"fp16"``, ``"fp32"``, ``"float32"``...)
    or a torch dtype; ``"?"`` or ``None`` means not answered yet; ``"tf32"`` is refused
    (not a tensor dtype). ``trace`` is an :class:`amp_lessons.trace.Trace` run on this
    device. ``ops`` are the ops that must all be predicted (lesson 02's five by default);
    a key outside them is refused by name; ``ops=None`` accepts any op the trace ran. A
    wrong prediction gets the rule that decided the op (lesson 02's rules 1-3), not the
    answer; ``reveal=True`` adds the dtype each op ran in.
    """
    if not predictions:
        return Verdict(False, ["no predictions: fill in the dict, one aten op per entry"])
    ran = sorted({r.op for r in trace.rows()})
    findings, passed = [], True
    if ops is not None:
        unknown = [op for op in predictions if op not in ops]
        missing = [op for op in ops if op not in predictions]
        if unknown or missing:
            if unknown:
                findings.append(f"not asked: {', '.join(map(repr, unknown))}; the exercise's "
                                f"ops are {', '.join(map(repr, ops))} (check the spelling)")
            if missing:
                findings.append(f"missing: {', '.join(map(repr, missing))}; predict all "
                                f"{len(ops)} ops, with '?' for the ones you have not decided")
            return Verdict(False, findings)
    for op, guess in predictions.items():
        records = trace.ops(op)
        if not records:
            passed = False
            findings.append(f"{op}: did not run in this trace; ops that ran: {', '.join(ran)}")
            continue
        predicted, problem = _parse_guess(op, guess)
        actual = {r.dtype for r in records}
        got = " and ".join(sorted(short(d) for d in actual))
        if problem is None and actual == {predicted}:
            findings.append(f"{op}: {got}, right (rule {records[0].rule})")
            continue
        passed = False
        sixteen = (torch.float16, torch.bfloat16)
        if problem is None and predicted in sixteen and actual <= set(sixteen):  # the other 16-bit dtype
            finding = (f"{op}: not yet. A 16-bit dtype, yes; which one did this run ask autocast for? "
                       "(the autocast context's dtype)")
        else:
            finding = problem or _rule_hint(op, records[0], trace.where)
        findings.append(finding + (f" [it ran in {got}]" if reveal else ""))
    return Verdict(passed, findings)


# --- 03_grad_scaler ------------------------------------------------------------------


def amp_step_as_given(model, opt, scaler, scheduler, x, y) -> bool:
    """03's exercise, as given: one fp16 training step with a GradScaler and an lr scheduler.

    It should return True when GradScaler skipped the step, and step the scheduler only
    when the optimizer really stepped. Two lines are wrong.
    """
    with torch.autocast(x.device.type, dtype=torch.float16):
        loss = torch.nn.functional.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    scheduler.step()
    opt.zero_grad(set_to_none=True)
    return False


def check_amp_step(step, device=None, bad_batches=(0, 3), overflow_batches=(5,), steps: int = 7) -> Verdict:
    """03: run the learner's ``step(model, opt, scaler, scheduler, x, y) -> skipped`` for
    ``steps`` batches of the digits, with AdamW, ``GradScaler(device, growth_interval=2)`` (so
    the scale grows within the run as well as halving) and ``StepLR``: an inf
    planted in the batches ``bad_batches`` (a corrupt example), and before each of
    ``overflow_batches`` the scale set to 2^40 (as after too much growth), so that its loss
    is finite but its scaled gradients overflow float16; the scale is put back after it.
    Check what the step returns, the weights, the optimizer's and the scheduler's step
    counts, and the lr_scheduler warning.

    A step counts as skipped when AdamW's own step count did not move, whatever skipped it:
    GradScaler finding an inf, or the learner's own check of the loss. The feedback names the
    applied steps the answer calls skipped, and says when a clean step was skipped on
    gradients an earlier step left in ``.grad``.
    """
    import warnings

    dev = pick_device(device)
    model = scaling_lesson_model().to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler(dev.type, growth_interval=2)  # it grows too: a changed scale is not a skip
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
    returned, skipped, unchanged, warned, carried = [], [], [], [], []
    for i in range(steps):
        x, y = lesson_data().batch(i, 64)
        if i in bad_batches:
            x = x.clone()
            x[0, 0] = float("inf")
        if i in overflow_batches:
            kept = scaler.state_dict()
            scaler.load_state_dict({**kept, "scale": 2.0**40})
        before = [p.detach().clone() for p in model.parameters()]
        taken = optimizer_steps(opt)
        carried.append(any(p.grad is not None and not torch.isfinite(p.grad).all() for p in model.parameters()))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                answer = step(model, opt, scaler, scheduler, x.to(dev), y.to(dev))
            except Exception as err:  # the learner's code: report it, do not crash the cell
                empty = isinstance(err, KeyError) and err.args == ("step",)
                return Verdict(False, [f"step {i} raised {type(err).__name__}: "
                                       f"{str(err).splitlines()[0] if str(err) else ''}"
                                       + ("; AdamW's state is empty until its first applied step: "
                                          "read it with opt.state[p].get('step', 0)" if empty else "")])
        warned += [str(w.message) for w in caught if SCHEDULER_WARNING in str(w.message)]
        if i in overflow_batches:
            scaler.load_state_dict(kept)
        returned.append(answer)
        skipped.append(optimizer_steps(opt) == taken)
        unchanged.append(all(torch.equal(a, p) for a, p in zip(before, model.parameters())))
    findings, passed = [], True

    def good(text):
        findings.append("✓ " + text)

    def bad(text):
        nonlocal passed
        passed = False
        findings.append("✗ " + text)

    truly = [i for i, s in enumerate(skipped) if s]
    applied = steps - len(truly)
    expected = sorted({*bad_batches, *overflow_batches})
    if truly == expected and all(unchanged[i] for i in truly):
        good(f"the optimizer skipped steps {truly}, the batches with an inf and the "
             f"overflow, and their weights stayed as they were; it applied the other {applied}")
    else:
        reached = [i for i in expected if i not in truly]
        needless = [i for i in truly if i not in expected]
        if reached:
            bad(f"steps {reached} should have been skipped (an inf in the batch, or the scale set to "
                "2^40), yet the optimizer stepped on them: let scaler.step(opt) decide (it skips a step "
                "whose gradients hold inf/NaN), with the loss scaled by scaler.scale(loss)")
        if needless:
            inherited = [i for i in needless if carried[i]]
            bad(f"steps {needless} were skipped although their batches were clean"
                + (f"; the gradients entering step {inherited[0]} already held inf/NaN from an earlier "
                   "step: backward() adds to .grad, so clear it every step (opt.zero_grad())"
                   if inherited else ""))
        if any(not unchanged[i] for i in truly):
            bad("a skipped step still changed the weights")
    if any(not isinstance(a, (bool, torch.Tensor)) or (isinstance(a, torch.Tensor) and a.numel() != 1)
           for a in returned):
        bad(f"step returned {[type(a).__name__ for a in returned][:3]}...; return one bool (or a "
            "one-element tensor): True when the step was skipped")
    else:
        said = [i for i, a in enumerate(returned) if bool(a)]
        if said == truly:
            good(f"it returns True exactly on the skipped steps {said}")
        else:
            flagged = [i for i in said if i not in truly]  # applied steps it calls skipped
            applied_steps = [i for i in range(steps) if i not in truly]
            missed = [i for i in truly if i not in said]
            only_overflow = missed and all(i in overflow_batches for i in missed)
            caught_some = any(i in said for i in bad_batches)  # it sees the batches with an inf
            bad(f"it returns True on steps {said}, but the skipped steps were {truly}"
                + (f"; steps {flagged} were applied (AdamW's step count moved), yet it returns True "
                   "on them" if flagged else "")
                + ("; it returns True on the applied steps after the first: a value kept before the "
                   "step and compared after must be a copy (float(opt.state[p]['step'])): the step "
                   "tensor is updated in place"
                   if len(applied_steps) > 1 and set(applied_steps[1:]) <= set(said) else "")
                + (f": the loss of step {missed[0]} was finite, only its scaled gradients "
                   "overflowed, so a check of the loss or the inputs cannot see that skip; "
                   "ask what GradScaler itself changes when it skips"
                   if only_overflow and caught_some and not flagged
                   else ": what changes in GradScaler when it skips a step, and only then?"))
    if not all(torch.isfinite(p).all() for p in model.parameters()):
        bad("the weights now hold inf/NaN: a batch with an inf reached the optimizer")
    if scheduler.last_epoch == applied and not warned:
        good(f"the scheduler stepped {scheduler.last_epoch} times, once per applied "
             "optimizer step, with no lr_scheduler warning")
    else:
        import textwrap

        said = textwrap.shorten(warned[0], 150, placeholder=" ...") if warned else ""
        if scheduler.last_epoch == applied:  # the right count: the warning is about the order
            bad(f"the scheduler stepped once per applied optimizer step, yet PyTorch warned: {said}; "
                "step the scheduler after scaler.step(opt) in each iteration")
        else:
            bad(f"the scheduler stepped {scheduler.last_epoch} times for {applied} applied "
                "optimizer steps" + (f" and warned: {said}" if warned else "")
                + "; call scheduler.step() only when the step was not skipped")
    return Verdict(passed, findings)

# --- 04_clipping ---------------------------------------------------------------------


def broken_clipping_loop(model, data, steps=6, accum_steps=4, max_norm=1.0, lr=0.5, batch_size=32):
    """04's exercise: fp16 training with gradient accumulation and clipping. Fix it."""
    device = next(model.parameters()).device
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    scaler = torch.amp.GradScaler()
    for step in range(steps):
        for micro in range(accum_steps):
            x, y = data.batch(step * accum_steps + micro, batch_size)
            with torch.autocast(device.type, dtype=torch.float16):
                logits = model(x.to(device))
                loss = torch.nn.functional.cross_entropy(logits, y.to(device)) / accum_steps
                scaler.scale(loss).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
        opt.zero_grad(set_to_none=True)


def fixed_clipping_loop(model, data, steps=6, accum_steps=4, max_norm=1.0, lr=0.5, batch_size=32):
    """04's exercise, solved: the reference :func:`check_clipping_loop` compares against."""
    device = next(model.parameters()).device
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    scaler = torch.amp.GradScaler(device.type)  # the device: GradScaler() means "cuda"
    for step in range(steps):
        for micro in range(accum_steps):
            x, y = data.batch(step * accum_steps + micro, batch_size)
            with torch.autocast(device.type, dtype=torch.float16):
                logits = model(x.to(device))
                loss = torch.nn.functional.cross_entropy(logits, y.to(device)) / accum_steps
            scaler.scale(loss).backward()  # inside autocast gave the same gradients
        scaler.unscale_(opt)  # once per optimizer step, after the last micro-batch
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)  # on true gradients
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)


# The max_norm 04's checker passes: between the smallest and the largest true norm of its 6
# steps (tests/test_clipping.py checks), so the reference clips some steps and not others,
# and a clip that never binds, a clip_grad_value_, or a loss not divided by accum_steps
# (which the clip would cut on every step) ends with other weights.
CHECK_MAX_NORM = 0.15

_LOOP_ERROR_HINTS = {
    "already been called": "unscale_ runs once per optimizer step: where in the loop does that put it?",
    "after step()": "unscale_ must come before step(), once per optimizer step",
    "No inf checks were recorded for this optimizer": "scaler.step found no gradient to check in "
    "this optimizer: did zero_grad run between the backward passes and step?",
    "No inf checks were recorded prior to update": "update() needs a step() before it: call both "
    "once per optimizer step",
}


def _run_clipping_loop(train, steps, accum_steps, lr, batch_size):
    """Run ``train`` on CPU from a fixed initialisation, with ``max_norm=CHECK_MAX_NORM``;
    return (model, weights before, log, warnings, error)."""
    import copy
    import warnings

    model = clipping_lesson_model(hidden=32)
    before = copy.deepcopy(model.state_dict())
    error = None
    with record_amp_calls() as log, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            train(model, digits(), steps=steps, accum_steps=accum_steps, max_norm=CHECK_MAX_NORM, lr=lr,
                  batch_size=batch_size)
        except Exception as err:  # the learner's loop: report it, do not crash the checker
            error = err
    return model, before, log, [str(w.message) for w in caught], error


def _weight_change(model, before) -> torch.Tensor:
    return torch.cat([(p.detach() - before[n]).flatten() for n, p in model.named_parameters()])


_REFERENCE_CHANGES: dict = {}


def _reference_change(steps, accum_steps, lr, batch_size) -> torch.Tensor:
    """The weight change of :func:`fixed_clipping_loop` (deterministic: computed once)."""
    key = (steps, accum_steps, lr, batch_size)
    if key not in _REFERENCE_CHANGES:
        ref, before, _, _, _ = _run_clipping_loop(fixed_clipping_loop, *key)
        _REFERENCE_CHANGES[key] = _weight_change(ref, before)
    return _REFERENCE_CHANGES[key]


def check_clipping_loop(train, backward_in_autocast_is_a_bug=None, steps=6, accum_steps=4) -> Verdict:
    """04: run the learner's version of :func:`broken_clipping_loop` and say, bug by bug,
    what is fixed and what is not.

    ``train`` has the signature of :func:`broken_clipping_loop`; it is run on the CPU on a
    fixed model and the digits, with every GradScaler, scale/unscale_/step/update and clip
    call recorded, and its result is compared with :func:`fixed_clipping_loop`'s.
    ``backward_in_autocast_is_a_bug``: the learner's answer (True or False) to "is calling
    backward inside the autocast block a bug?". On the loop as given it only says how many
    of the three bugs remain, and where.
    """
    lr, batch_size = 0.5, 32
    model, before, log, caught, error = _run_clipping_loop(train, steps, accum_steps, lr, batch_size)
    planted = [_scaler_finding(log, train), _clip_finding(log, error),
               _call_count_finding(log, error, steps, accum_steps)]
    question = _autocast_answer_finding(log, backward_in_autocast_is_a_bug)
    if _is_as_given(train):
        return _as_given_verdict(planted, question)
    results = [*_loop_error_finding(error), *(f for found in planted for f in found), question]
    if error is None:
        results.append(_weights_finding(model, before, log, steps, accum_steps, lr, batch_size))
    results += [(True, f"warning from your loop: {w}") for w in sorted({w for w in caught if "GradScaler" not in w})]
    return Verdict(all(ok for ok, _ in results), [text for _, text in results])


_PLANTED = ("how the GradScaler is built", "where the clip runs", "how often unscale_, step and update run")


def _is_as_given(train) -> bool:
    """Whether ``train`` is :func:`broken_clipping_loop` or a copy of its body (name and
    docstring aside): then 04's checker does not itemise the bugs, since that would give the
    exercise away before the learner has changed anything."""
    import ast
    import inspect
    import textwrap

    def body(fn):
        try:
            (tree,) = ast.parse(textwrap.dedent(inspect.getsource(fn))).body
        except (OSError, TypeError, SyntaxError, ValueError):
            return None
        if not isinstance(tree, ast.FunctionDef):
            return None
        stmts = tree.body[1:] if ast.get_docstring(tree) is not None else tree.body
        return [ast.dump(stmt) for stmt in stmts]

    return train is broken_clipping_loop or (callable(train) and body(train) == body(broken_clipping_loop))


def _as_given_verdict(planted, question) -> Verdict:
    """04's checker on the loop as given: how many planted bugs remain and where, no fixes."""
    left = [name for name, found in zip(_PLANTED, planted) if any(not ok for ok, _ in found)]
    head = (f"bugs: {len(left)} of {len(_PLANTED)} remain, in {'; '.join(left)}. This is the loop as "
            "given: change it and run this cell again, and the checker says bug by bug what it sees")
    return Verdict(False, [head, question[1]])


def _bug(text: str) -> tuple[bool, str]:
    """A finding of :func:`check_clipping_loop` that fails the exercise."""
    return False, "bug: " + text


def _loop_error_finding(error) -> list[tuple[bool, str]]:
    """04's checker: the error the learner's loop raised, with a hint where one is known."""
    if error is None:
        return []
    msg = str(error).splitlines()[0] if str(error) else ""
    hint = next((h for key, h in _LOOP_ERROR_HINTS.items() if key in msg), "")
    return [_bug(f"the loop raised {type(error).__name__}: {msg}" + (f" ({hint})" if hint else "")
                 + ". What ran before it is checked below; the call counts and the weights are "
                 "checked once the loop runs to the end")]


def _hard_coded_device(train) -> str | None:
    """The device a learner's loop names in ``GradScaler("cpu")`` (or 'cuda'), read from its
    source; None when it passes a variable, or the source cannot be read."""
    import inspect
    import re

    try:
        source = inspect.getsource(train)
    except (OSError, TypeError):
        return None
    found = re.search(r"GradScaler\(\s*(?:device\s*=\s*)?['\"](\w+)['\"]\s*[,)]", source)  # a bare literal
    return found.group(1) if found else None


def _scaler_finding(log, train=None) -> list[tuple[bool, str]]:
    """04's checker, bug 1: the GradScaler and its device."""
    if not log.scalers:
        return [_bug("no torch.amp.GradScaler(...) call was seen in the loop: fp16 needs one, built there "
                     "as torch.amp.GradScaler(device.type) (one imported by name, or torch.cuda.amp's, "
                     "is not seen)")]
    s = log.scalers[0]
    if not s["device_given"]:
        state = "enabled" if s["enabled"] else "it warned and disabled itself"
        return [_bug(f"torch.amp.GradScaler() was built without a device (here: {state}). A bug off "
                     "CUDA only: this checker runs the loop on the CPU. Which device does a GradScaler "
                     "built without one assume (lesson 03)? Build it so that the loop runs on any device")]
    if s["device"] != "cpu":
        return [_bug(f"GradScaler({s['device']!r}) for a model on the cpu: pass the model's device, "
                     "torch.amp.GradScaler(device.type)")]
    if not s["enabled"]:
        return [_bug("the GradScaler is built with enabled=False: fp16 needs it on")]
    named = _hard_coded_device(train) if train is not None else None
    if named is not None:
        return [_bug(f"GradScaler({named!r}) names its device: right on this checker's CPU, wrong on another "
                     "device. Build it from the device the model is on")]
    return [(True, "fixed: the GradScaler is built for the model's device and is on")]


def _clip_finding(log, error) -> list[tuple[bool, str]]:
    """04's checker, bug 2: clip after unscale_."""
    clips, scaled = log.clips, log.scaled_clips
    if not clips and error is not None:
        return []  # it stopped before the first clip
    if not clips:
        return [_bug("the loop no longer clips: keep clip_grad_norm_, after scaler.unscale_(opt) (a clip imported "
                     "by name, from torch.nn.utils import clip_grad_norm_, is not seen: call "
                     "torch.nn.utils.clip_grad_norm_)")]
    late = _clips_after_step(log)
    if late:
        return [_bug(f"{late} of {len(clips)} clips ran after scaler.step(opt), when the optimizer had already "
                     "applied the gradients: the clip changed nothing the step used. Where must it sit?")]
    if scaled:
        enabled = bool(log.scalers) and log.scalers[0]["enabled"]
        return [_bug(f"{len(scaled)} of {len(clips)} clips ran before scaler.unscale_(opt)"
                     + (", on gradients still multiplied by the loss scale" if enabled else
                        " (this scaler is off, but once it is on, those gradients are multiplied by the loss "
                        "scale)")
                     + ": the threshold acts as max_norm/scale. What must happen to the gradients before "
                     "the clip measures them?")]
    return [(True, "fixed: every clip runs after scaler.unscale_(opt) and before scaler.step(opt)")]


def _clips_after_step(log) -> int:
    """04's checker: how many clips ran after ``scaler.step`` and before the ``update`` that
    ends that optimizer step (by call order)."""
    late, stepped = 0, False
    for call in log.calls:
        if call.name == "step":
            stepped = True
        elif call.name == "update":
            stepped = False
        elif call.name in ("clip_grad_norm_", "clip_grad_value_") and stepped:
            late += 1
    return late


def _step_calls(log) -> dict[str, int]:
    """How often the loop called unscale_, step and update (04's checker)."""
    return {name: log.count_called(name) for name in ("unscale_", "step", "update")}


def _call_count_finding(log, error, steps, accum_steps) -> list[tuple[bool, str]]:
    """04's checker, bug 3: unscale_, clip, step and update once per optimizer step (a loop
    that stopped early made fewer calls than it would have: nothing to count)."""
    if error is not None:
        return []
    counts, backwards = _step_calls(log), log.count("scale")
    if any(n != steps for n in counts.values()):
        ran = ", ".join(f"{name} {n}x" for name, n in counts.items())
        return [_bug(f"{ran} for {steps} optimizer steps of {accum_steps} micro-batches: which of these "
                     "calls belong once per optimizer step, and where in the loop does that put them?")]
    if len(log.scalers) > 1:
        return [_bug(f"a GradScaler was built {len(log.scalers)} times: build one before the loop, "
                     "so that its scale carries from step to step")]
    if backwards != steps * accum_steps:
        return [_bug(f"scaler.scale(loss).backward() ran {backwards}x; expected one per micro-batch "
                     f"({steps * accum_steps})")]
    return [(True, f"fixed: unscale_, step and update run once per {accum_steps} micro-batches")]


def _autocast_answer_finding(log, answer) -> tuple[bool, str]:
    """04's checker, the question: is backward inside autocast a bug here? Answered against a
    measurement on this model."""
    inside = sum(c.info["in_autocast"] for c in log.calls if c.name == "scale")
    where = "inside" if inside else "outside"
    if answer is None or not isinstance(answer, bool):
        got = "" if answer is None else f" (got {answer!r}, a {type(answer).__name__})"
        return False, ("question: is calling backward inside the autocast block one of this "
                       "loop's bugs, one that changes what it computes? Answer with "
                       f"backward_in_autocast_is_a_bug=True or False{got}")
    same = backward_inside_autocast_matches(clipping_lesson_model(hidden=32), *digits().batch(0, 32))
    evidence = (f"measured on this model on the CPU, where this checker runs it, its gradients inside and "
                f"outside are {'identical' if same else 'NOT identical'} bit for bit")
    caveat = ("Autocast is still on during a backward called inside it, and acts on backward "
              "ops as on any op: a region the forward ran under autocast(enabled=False), or a "
              "custom autograd Function without custom_bwd (lesson 02), gets 16-bit matmuls "
              "in its backward (on a GPU this checker's measurement was not made). That is why the card and "
              "PyTorch's docs put backward outside")
    if answer and same:
        return False, (f"question, think again: {evidence}. {caveat}. Does this loop's model have such a region? "
                       f"Your loop runs it {where}")
    if answer:
        return True, f"right: here it changes the gradients ({evidence}). {caveat}. Your loop runs it {where}"
    if same:
        return True, f"right: in this loop it is not a bug ({evidence}). {caveat}. Your loop runs it {where}"
    return False, f"it changes the gradients here ({evidence}). {caveat}. Your loop runs it {where}"


def _weights_finding(model, before, log, steps, accum_steps, lr, batch_size) -> tuple[bool, str]:
    """04's checker, the result: the learner's weights against the reference loop's, with the
    bugs above that explain a difference."""
    mine = _weight_change(model, before)
    theirs = _reference_change(steps, accum_steps, lr, batch_size)
    off = float(torch.linalg.vector_norm(mine - theirs) / torch.linalg.vector_norm(theirs))
    if off < 1e-3:
        return True, "fixed: the weights end where the reference loop's do"
    disabled = bool(log.scalers) and not log.scalers[0]["enabled"]
    misplaced = any(n != steps for n in _step_calls(log).values())
    other_clip = any(c.name != "clip_grad_norm_" or c.info["threshold"] != CHECK_MAX_NORM for c in log.clips)
    causes = [text for found, text in (
        (misplaced, "the steps taken per micro-batch"),
        (bool(log.scaled_clips) and not disabled, "the clips on scaled gradients"),
        (_clips_after_step(log) > 0, "the clips after scaler.step(opt)"))
        if found]  # a disabled scaler alone leaves these weights within 1e-3 of the reference's
    why = (f"the bugs above explain it ({', '.join(causes)}): fix those first" if causes else
           f"the clip is not the given one: the reference calls clip_grad_norm_ with the max_norm passed in "
           f"({CHECK_MAX_NORM} here)" if other_clip else
           "unscale_, clip, step and update are in place, so look at what they act on: "
           "is each loss divided by accum_steps, and are the gradients zeroed once per "
           "optimizer step, after it, and not between micro-batches?")
    return _bug(f"the weights moved {measured(off, '.0%')} away from the reference loop's (relative to its "
                f"total change): {why}")


# --- 05_putting_it_together ----------------------------------------------------------


def broken_setup(device_type: str = "cpu"):
    """05's exercise: the pieces of a float16 mixed-precision run. Two lines are wrong."""
    model = mlp(64, 64, 10).to(device_type).half()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler(device_type, enabled=False)
    dtype = torch.float16
    return model, optimizer, scaler, dtype


_SETUP_ERROR_HINTS = {
    "Attempting to unscale FP16 gradients": "GradScaler refuses float16 gradients. A gradient "
    "has its parameter's dtype: which dtype are these weights, and which does autocast expect?",
    "No inf checks were recorded": "scaler.step found no gradient in this optimizer to check: "
    "which parameters was the optimizer built on?",
}


def _setup_pieces(setup, dev) -> tuple[tuple | None, str | None]:
    """``setup(dev.type)``'s four pieces, or why they are not usable (lesson 05's checker)."""
    try:
        pieces = setup(dev.type)
    except Exception as err:
        return None, f"setup({dev.type!r}) raised {type(err).__name__}: {err}"
    if not isinstance(pieces, tuple) or len(pieces) != 4:
        return None, (f"setup({dev.type!r}) must return four things, (model, optimizer, scaler, dtype); "
                      f"got {type(pieces).__name__}" + (f" of {len(pieces)}" if isinstance(pieces, tuple) else ""))
    kinds = ((torch.nn.Module, "model", "a torch.nn.Module"), (torch.optim.Optimizer, "optimizer",
             "a torch.optim optimizer"), (torch.amp.GradScaler, "scaler", "a torch.amp.GradScaler"),
             (torch.dtype, "dtype", "a torch dtype"))
    for value, (kind, name, what) in zip(pieces, kinds):
        if not isinstance(value, kind):
            return None, f"the {name} must be {what}; got {type(value).__name__}"
    return pieces, None


def _half_weights_finding(low, params, optimizer) -> str:
    """What 16-bit weights do, said as a question (lesson 05 measures the answer); float64
    weights, which keep small updates, get their own finding."""
    if all(p.dtype == torch.float64 for p in low):
        return (f"{len(low)} of {len(params)} parameter tensors are torch.float64: the recipe keeps "
                "master weights in float32; float64 holds 8 bytes a weight, and so do its gradients "
                "and each of Adam's moments")
    text = (f"{len(low)} of {len(params)} parameter tensors are {low[0].dtype}: an optimizer adds "
            "its updates to these weights; in which dtype do small updates survive? (autocast "
            "casts weights for the matmuls itself)")
    group = next((g for g in optimizer.param_groups if g.get("eps") and g["params"]), None)
    if group is None or "betas" not in group:
        return text
    if group.get("fused"):
        return text + (f". The same mistake stores Adam's exp_avg_sq in {low[0].dtype}, where "
                       f"v = (1 - beta2) g^2 = {1 - group['betas'][1]:g} g^2 rounds to 0 for small gradients: "
                       "the fused kernel then divides by a v that forgot the past gradients")
    if eps_in(low[0].dtype, group["eps"]) == 0:
        return text + (f". The same mistake makes Adam's eps={group['eps']:g} 0 in {low[0].dtype}, and "
                       f"v = (1 - beta2) g^2 = {1 - group['betas'][1]:g} g^2 rounds to 0 for small gradients: "
                       "m / (sqrt(v) + eps) divides by zero")
    return text


MIN_INIT_SCALE = 2.0**10  # 05: lifts float16's smallest subnormal, 2^-24, to its smallest normal, 2^-14


def check_setup(setup, device=None, steps: int = 5) -> Verdict:
    """Check ``setup(device_type) -> (model, optimizer, scaler, dtype)`` for mixed precision.

    The task is a float16 run, so a bfloat16 dtype is refused. Inspects the weights' dtype
    (and, where they are 16-bit, what that does to Adam), the GradScaler (on, for the
    right device, and starting at a scale of at least 2**10); then trains ``steps`` steps on the digits with the card's recipe and
    looks for inf/NaN weights and losses and for weights that never moved; an optimizer that holds not
    all of the model's parameters (or other tensors) is named. Used in 05.
    """
    dev = pick_device(device)
    findings: list[str] = []
    passed = True

    def bug(text):
        nonlocal passed
        passed = False
        findings.append(text)

    pieces, why = _setup_pieces(setup, dev)
    if pieces is None:
        return Verdict(False, [why])
    model, optimizer, scaler, dtype = pieces
    if dtype == torch.bfloat16:
        bug("dtype is torch.bfloat16, but the task is a float16 run: keep float16 and make that "
            "run train safely (bfloat16 is the right choice elsewhere, not the answer here)")
    elif dtype != torch.float16:
        bug(f"dtype is {dtype}: the task is a float16 run, so autocast's dtype is torch.float16")
    params = list(model.parameters())
    held = {id(p) for g in optimizer.param_groups for p in g["params"]}
    left_out = [p for p in params if id(p) not in held]
    if len(left_out) == len(params):
        bug("the optimizer holds none of this model's parameters: it was built on other tensors "
            "(another model, or a copy made before .to() or .half()). What must it be given?")
    elif left_out:
        bug(f"the optimizer holds {len(params) - len(left_out)} of this model's {len(params)} parameter "
            f"tensors: the other {len(left_out)} ({sum(p.numel() for p in left_out):,} weights) are never "
            "updated. What must it be given?")
    low = [p for p in params if p.dtype != torch.float32]
    if low:
        bug(_half_weights_finding(low, params, optimizer))
    else:
        findings.append("right: the weights are float32 (master weights)")
    scaler_device = getattr(scaler, "_device", dev.type)
    if dtype == torch.float16 and not scaler.is_enabled() and scaler_device != dev.type:
        bug(f"the GradScaler was built for {scaler_device!r} (what torch.amp.GradScaler() means "
            f"when no device is given), and the model runs on {dev.type!r}: it warned and disabled "
            "itself, so nothing is scaled. It needs to know the model's device")
    elif dtype == torch.float16 and not scaler.is_enabled():
        bug("float16 with a GradScaler that does not scale (scaler.is_enabled() is False): small "
            "gradients flush to zero")
    elif dtype == torch.float16 and scaler.get_scale() <= 1:
        bug(f"the GradScaler starts at scale {scaler.get_scale():g}: a loss multiplied by at most 1 lifts "
            "no small gradient out of float16's flush to zero, and it grows only after "
            f"{scaler.get_growth_interval():,} steps without overflow. Keep the default init_scale "
            "(2.0**16): GradScaler starts high and lowers the scale where gradients overflow")
    elif dtype == torch.float16 and scaler.get_scale() < MIN_INIT_SCALE:
        bug(f"the GradScaler starts at scale {scaler.get_scale():g}, below 2**10: scaled by it, a gradient of "
            "2^-24 (float16's smallest subnormal) stays below its smallest normal, 2^-14, so it keeps fewer "
            "mantissa bits; the scale grows only after "
            f"{scaler.get_growth_interval():,} steps without overflow. Keep the default init_scale (2.0**16)")
    elif dtype == torch.float16:
        findings.append("right: float16 with a GradScaler")
    elif scaler.is_enabled():
        findings.append("note: bfloat16 needs no GradScaler (harmless, but it does nothing useful)")
    if scaler.is_enabled() and scaler_device != dev.type:
        bug(f"the GradScaler is for {scaler_device!r} but the model runs on {dev.type!r}: "
            "it needs to be built for the model's device")
    data = digits()
    losses, skipped = [], 0
    start = [p.detach().clone() for p in params]
    try:
        for i in range(steps):
            x, y = (t.to(dev) for t in data.batch(i, 64))
            with torch.autocast(dev.type, dtype=dtype):
                loss = torch.nn.functional.cross_entropy(model(x), y)
            scaler.scale(loss).backward()
            scale = scaler.get_scale() if scaler.is_enabled() else None
            scaler.step(optimizer)
            scaler.update()
            skipped += scale is not None and scaler.get_scale() < scale  # the scale falls on a skipped step
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
    except Exception as err:
        msg = str(err).splitlines()[0] if str(err) else ""
        hint = next((h for key, h in _SETUP_ERROR_HINTS.items() if key in msg), "")
        bug(f"training raised {type(err).__name__}: {msg}" + (f" ({hint})" if hint else ""))
        return Verdict(passed, findings)
    bad = sum(int((~torch.isfinite(p)).sum()) for p in params)
    total = sum(p.numel() for p in params)
    moved = sum(int((p.detach() != s).sum()) for p, s in zip(params, start))
    if bad:
        bug(f"after {steps} steps {measured(bad, ',')} of {total:,} weights are inf/NaN")
    elif not moved and skipped == steps:
        bug(f"the GradScaler skipped all {steps} steps (inf/NaN gradients each time), so no weight changed")
    elif not moved:
        bug(f"after {steps} steps no weight has changed: look at what the optimizer was given, "
            "its learning rate first")
    elif not all(math.isfinite(v) for v in losses):
        bug(f"the weights stay finite, but the loss went {measured(losses[0], '.2f')} -> "
            f"{measured(losses[-1], '.2f')} in {steps} steps: a run that trains keeps a finite loss; "
            "look at the optimizer's settings (the card's recipe changes none of them)")
    else:
        findings.append(f"after {steps} steps every weight is finite and {measured(moved / total, '.0%')} of "
                        f"them changed; loss {measured(losses[0], '.2f')} -> {measured(losses[-1], '.2f')}")
    return Verdict(passed, findings)


# --- 08_fp8 --------------------------------------------------------------------------


def row_scale_as_given(x, name="fp8_e4m3"):
    """08's exercise, as given: one float32 scale per row of ``x`` (shape (rows, 1)) that
    puts each row's largest magnitude on the format's largest value. One thing is wrong."""
    largest = torch.finfo(torch.float8_e4m3fn if name == "fp8_e4m3" else torch.float8_e5m2).max
    return largest / x.float().abs().amax(dim=1, keepdim=True)


def _row_scale_cases():
    """Exact inputs (powers of two times small integers): ordinary rows at 2^-36 (as small as
    08's gradients get), 2^-20, 2^-6, 2^0 and 2^5, an outlier row, an all-zero row (a dead ReLU
    unit's gradient), a row with one nonzero value, a row bf16 cannot hold (its amax,
    7.5 * (1 + 2^-12), needs 16 significant bits; bf16 keeps 8), and a row at 2^-124 (amax
    3.5e-37: nonzero, yet ``max / amax`` overflows float32). Returns the rows and the zero
    row's index."""
    cols = torch.arange(16, dtype=torch.float32) - 7.5
    rows = [cols * 2.0**e for e in (-36, -20, -6, 0, 5)] + [cols * 2.0**20]
    zero_row = len(rows)
    rows += [torch.zeros(16), torch.where(cols == 0.5, -3.0, 0.0), cols * (1 + 2.0**-12), cols * 2.0**-124]
    return torch.stack(rows), zero_row


def _as_given(fn) -> bool:
    """Whether ``fn`` is 08's exercise function unchanged (or copied under another name)."""
    code = getattr(fn, "__code__", None)
    return code is not None and code.co_code == row_scale_as_given.__code__.co_code


def check_row_scale(fn) -> Verdict:
    """08: check the learner's ``fn(x, name) -> scales`` on exact inputs for e4m3 and e5m2
    (and on a bfloat16 ``x`` in e4m3): one float32 scale per row, finite and positive (an
    all-zero row and a nonzero row whose ``max / amax`` overflows float32 included), and each
    other nonzero row's largest magnitude landing on the format's largest value up to float32
    rounding (``max / amax``: neither a scale that only keeps the row in range, nor one a few
    percent too large that the cast's rounding would hide).
    For the function as given, a bad scale is named without saying why."""
    import math

    rows, zero_row = _row_scale_cases()
    findings, passed = [], True
    for name, x in (("fp8_e4m3", rows), ("fp8_e5m2", rows), ("fp8_e4m3", rows.bfloat16())):
        fmt = format_info(name)
        top = fmt.max
        label = name if x.dtype == torch.float32 else f"{name}, x in bfloat16"
        try:
            scale = fn(x.clone(), name)
        except Exception as err:
            return Verdict(False, [f"fn(x, {name!r}) raised {type(err).__name__}: {err}"])
        x = x.float()  # the values the scales are for
        if not isinstance(scale, torch.Tensor):
            return Verdict(False, [f"fn(x, {name!r}) returned {type(scale).__name__}: return a tensor of scales"])
        if tuple(scale.shape) != (x.shape[0], 1):
            return Verdict(False, [f"{label}: the scales have shape {tuple(scale.shape)}; per row means one "
                                   f"per row, shape ({x.shape[0]}, 1), each from that row's own amax"])
        right = scale.dtype == torch.float32
        if not right:
            findings.append(f"{label}: the scales are {scale.dtype}; torch._scaled_mm takes float32 scales")
        bad = [i for i, s in enumerate(scale.flatten().tolist()) if not (math.isfinite(s) and s > 0)]
        tiny = top / torch.finfo(torch.float32).max  # below this amax, top / amax overflows float32
        row_amax = x.abs().amax(dim=1)
        if bad:
            passed = False
            first = scale.flatten()[bad[0]].item()
            if _as_given(fn):
                findings.append(f"{label}: the scale of row {bad[0]} is {first}: a scale must be finite "
                                "and positive for every row")
                continue
            words = ("all zeros. What is its amax, and what does your formula give for it? A scale "
                     "must be finite and positive even where a row holds nothing" if bad[0] == zero_row
                     else f"not all zeros: its amax is {row_amax[bad[0]].item():.2g}, and its scale must be "
                     "finite and positive too" if 0 < row_amax[bad[0]] < tiny
                     else "not finite and positive")
            if math.isinf(first):
                words += f"; in float32 {top:g} / amax is inf for every amax below {tiny:.2g}"
            findings.append(f"{label}: the scale of row {bad[0]} is {first}; row {bad[0]} is {words}")
            continue
        peak = (x * scale.float()).abs().amax(dim=1).double()  # what the cast sees, in float32
        reachable = row_amax >= tiny  # the rows whose max / amax float32 holds
        close = 4 * torch.finfo(torch.float32).eps * top  # max / amax, then x * scale: two float32 roundings
        over = [i for i in range(len(peak)) if reachable[i] and peak[i] > top + close]
        low = [i for i in range(len(peak)) if reachable[i] and peak[i] < top - close]
        if over:
            i = over[0]
            stored = "inf" if fmt.has_inf else "448 or NaN"
            fate = (f", too large for {top:g}: a plain cast stores {stored}" if fmt.overflows(peak[i]) else
                    f": the cast rounds it back to {top:g}, yet the scale is too large: it should carry "
                    f"the row's amax onto {top:g} itself")
            low_end, high_end = x[i].min().item(), x[i].max().item()
            sign = (f"; this row's largest magnitude is a negative value, {low_end:g}: does your amax "
                    "see it?" if low_end < 0 and -low_end > high_end else "")
            findings.append(f"{label}: row {i} reaches {peak[i].item():g} after scaling{fate}{sign}")
        if low:
            same = bool((scale == scale.flatten()[0]).all())
            pow2 = bool((torch.frexp(scale.float()[reachable])[0] == 0.5).all())  # no exact scale here is one
            fine = [i for i in range(len(peak)) if reachable[i] and i not in low and i not in over]
            smallest = fine and all(row_amax[i] < min(row_amax[j] for j in fine) for i in low)
            i = low[0]
            ratio = top / scale.flatten()[i].item() / row_amax[i].item()  # the amax the formula used, over the row's
            lifted = f"by {ratio - 1:.1%}" if ratio < 2 else f"{ratio:.2g}-fold"
            why = ("every row got the same scale, which is per-tensor scaling: the largest row sets it and "
                   "the small rows land low. Per row, each row's scale comes from its own amax" if same
                   else f"power-of-two scales are a recipe of their own (quantize's power_of_2); this "
                   f"exercise asks for the exact one, which carries the row's amax onto {top:g} itself" if pow2
                   else f"only the smallest rows land low: the scale divides by {top / scale.flatten()[i].item():.3g} "
                   f"where the row's amax is {row_amax[i].item():.3g}: an epsilon added to the amax, or a floor "
                   f"under it, lifts this row's amax {lifted}. A floor far below "
                   "every amax leaves each row its own" if smallest
                   else f"the scale should carry the row's amax onto {top:g} itself, so the row uses "
                   "the whole range")
            findings.append(f"{label}: row {i}'s largest value lands at {peak[i].item():g}, not at "
                            f"{top:g}: {why}")
        right = right and not over and not low
        passed = passed and right
        if right:
            unreachable = [i for i in range(len(peak)) if 0 < row_amax[i] < tiny]
            findings.append(f"{label}: right: every row gets a finite positive scale, and every nonzero row's "
                            f"largest value lands on {top:g} but row {unreachable[0]}'s, whose {top:g} / amax "
                            "overflows float32")
    return Verdict(passed, findings)

# --- 06_error_messages ---------------------------------------------------------------


def two_model_loop_as_given(models, optimizers, schedulers, batches):
    """06's exercise: two models trained in fp16 with one GradScaler, an lr scheduler each.
    Three lines are wrong."""
    scaler = torch.amp.GradScaler()
    for x, y in batches:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = sum(torch.nn.functional.cross_entropy(m(x), y) for m in models)
        scaler.scale(loss).backward()
        for opt, scheduler in zip(optimizers, schedulers):
            scaler.step(opt)
            scaler.update()
            scheduler.step()
            opt.zero_grad(set_to_none=True)


class _MarkedBatches(list):
    """06's exercise batches; iterating notes where in the call log each batch began, so that
    the checker can tell which batches reached ``scaler.scale``."""

    def __init__(self, batches, log):
        super().__init__(batches)
        self.log, self.marks = log, []

    def __iter__(self):
        for batch in super().__iter__():
            self.marks.append(len(self.log.calls))
            yield batch

    def spans(self) -> list[list]:
        """The calls of each batch the loop took, in order."""
        ends = [*self.marks[1:], len(self.log.calls)]
        return [self.log.calls[start:end] for start, end in zip(self.marks, ends)]

    @property
    def current(self) -> int:
        """The index of the batch the loop took last (-1 before the first)."""
        return len(self.marks) - 1

    def fed(self) -> list[int]:
        """The indices of the batches during which the loop called ``scaler.scale``."""
        return [i for i, calls in enumerate(self.spans()) if any(c.name == "scale" for c in calls)]



class _OneScalerLog:
    """06's exercise: the shared call log as one GradScaler writes to it (each call tagged with
    the scaler's index in ``log.scalers``)."""

    def __init__(self, log, index):
        self.log, self.index = log, index

    def add(self, name, **info):
        self.log.add(name, scaler=self.index, **info)


@contextlib.contextmanager
def _record_every_scaler():
    """06's exercise: log every GradScaler built inside and its scale/unscale_/step/update
    calls, however the loop imported the class (``torch.amp.GradScaler``, ``from torch.amp
    import GradScaler``, ``torch.cuda.amp.GradScaler``): the class's own ``__init__`` is
    wrapped, and restored on exit. Yields the :class:`~amp_lessons.clipping.AmpCallLog`."""
    log, cls = AmpCallLog(), torch.amp.grad_scaler.GradScaler
    real_init = cls.__init__

    def __init__(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        log.scalers.append({"device_given": bool(args) or "device" in kwargs, "device": str(self._device),
                            "enabled": self.is_enabled()})
        log.trackers.append(_Tracker(self, _OneScalerLog(log, len(log.scalers) - 1)))

    cls.__init__ = __init__
    try:
        yield log
    finally:
        cls.__init__ = real_init
        for t in log.trackers:
            t.unwrap()


def _update_order(log, marks) -> tuple[list[int], list[int], list[int], list[int]]:
    """06's exercise, per GradScaler and across batches: (its ``update()`` count, how many
    batches it scaled, the batches in
    which an update fell between that scaler's ``scale`` and its last ``step``, the batches not
    followed by exactly one update before the scaler's next ``scale``). An update at the top
    of the next iteration counts for the batch before it. ``marks``: where each batch began."""
    counts, fed, inside, unmatched = [], [], set(), set()
    for k in range(len(log.scalers)):
        calls = [(pos, c.name) for pos, c in enumerate(log.calls) if c.info.get("scaler") == k]
        counts.append(sum(name == "update" for _, name in calls))
        batch_of = {pos: bisect.bisect_right(marks, pos) - 1 for pos, _ in calls}
        scaled = sorted({batch_of[pos] for pos, name in calls if name == "scale"})
        fed.append(len(scaled))
        for i, nxt in zip(scaled, [*scaled[1:], None]):
            first = min(pos for pos, name in calls if name == "scale" and batch_of[pos] == i)
            last = max([first] + [pos for pos, name in calls if name == "step" and batch_of[pos] == i])
            end = len(log.calls) if nxt is None else min(
                pos for pos, name in calls if name == "scale" and batch_of[pos] == nxt)
            updates = [pos for pos, name in calls if name == "update"]
            if any(first < pos < last for pos in updates):
                inside.add(i)
            if sum(last < pos < end for pos in updates) != 1:
                unmatched.add(i)
    return counts, fed, sorted(inside), sorted(unmatched)


def _overflow_in_model_1(model, batches, at: int) -> None:
    """06's exercise: during batch ``at``, model 1's first gradient holds an inf (an overflow
    in that model only: the scaler skips its optimizer and steps model 2's)."""
    def hook(g):
        if batches.current != at:
            return g
        g = g.clone()
        g.view(-1)[0] = float("inf")
        return g

    next(model.parameters()).register_hook(hook)


@contextlib.contextmanager
def _record_step_order(optimizers, schedulers):
    """06's exercise: the order of every ``scheduler.step()`` and ``GradScaler.step(optimizer)``
    call, as ``("sched", i)`` and ``("step", i)`` with ``i`` the model's index. The class's
    ``step`` is wrapped before the loop builds its scaler, and restored on exit."""
    order, cls = [], torch.amp.grad_scaler.GradScaler
    real_step, index = cls.step, {id(o): i for i, o in enumerate(optimizers)}

    def step(self, optimizer, *args, **kwargs):
        order.append(("step", index.get(id(optimizer))))
        return real_step(self, optimizer, *args, **kwargs)

    def sched_step(i, real):
        def wrapper(*args, **kwargs):
            order.append(("sched", i))
            return real(*args, **kwargs)
        return wrapper

    cls.step = step
    for i, s in enumerate(schedulers):
        s.step = sched_step(i, s.step)
    try:
        yield order
    finally:
        cls.step = real_step
        for s in schedulers:
            del s.step


def _two_model_order_findings(bug, order, n: int) -> bool:
    """06's exercise: one of the ``n`` optimizers never given to ``scaler.step``, or a scheduler
    stepped before its optimizer's ``scaler.step``, as a bug. True when one was found."""
    models = range(n)
    never = [i + 1 for i in models if ("step", i) not in order]
    if never:
        bug(f"{'optimizers' if len(never) > 1 else 'optimizer'} {' and '.join(map(str, never))} never went "
            "through scaler.step, so that model never trained: scaler.step(opt) for each optimizer (section 3)")
        return True
    early = [i + 1 for i in models
             if any(order[:k].count(("sched", i)) >= order[:k].count(("step", i))
                    for k, call in enumerate(order) if call == ("sched", i))]
    if early:
        many = len(early) > 1
        whose = "their optimizers'" if many else "its optimizer's"
        bug(f"{'schedulers' if many else 'scheduler'} {' and '.join(map(str, early))} stepped before "
            f"{whose} scaler.step, the order PyTorch's 'Detected call "
            "of `lr_scheduler.step()` before `optimizer.step()`' names: step a scheduler after scaler.step, "
            "and only when that step ran (section 1)")
        return True
    return False


def _two_model_schedule_findings(bug, findings, taken, stepped, warned, fed, steps, bad, one_model):
    """06's exercise: what the schedulers and optimizers did, as findings. ``bad``: the batches
    whose input holds an inf; ``one_model``: the batch at which only model 1 overflows; ``fed``
    is None when the loop built no GradScaler."""
    if fed is None:
        bug("not seen yet: without a GradScaler no step is skipped, so the schedulers' guard could not be "
            "checked")
        return
    skipped_by_hand = [i for i in bad if i not in fed]
    clean = [i for i in fed if i not in bad]
    expected = [len([i for i in clean if i != one_model]), len(clean)]
    if warned or any(s > t for s, t in zip(stepped, taken)):
        bug(f"the schedulers stepped {stepped} times for {taken} AdamW steps"
            + (", and PyTorch warned 'Detected call of `lr_scheduler.step()` before `optimizer.step()`'"
               if warned else "") + ": a scheduler moved on for a step GradScaler skipped (section 1)"
            + (f" (at batch {one_model} the checker put an inf in model 1's gradient alone)"
               if one_model in fed and stepped[0] > taken[0] else ""))
    elif stepped != taken:
        never = [i + 1 for i, s in enumerate(stepped) if s == 0]
        behind = [i + 1 for i, (s, t) in enumerate(zip(stepped, taken)) if 0 < s < t]
        bug(f"the schedulers stepped {stepped} times for {taken} AdamW steps: "
            + (f"{'schedulers' if len(never) > 1 else 'scheduler'} {' and '.join(map(str, never))} never "
               "stepped, so the lr stayed where it started; step each one after every step its "
               "optimizer takes (section 1)"
               if never else
               f"scheduler {' and '.join(map(str, behind))} missed steps its optimizer took. At batch "
               f"{one_model} only model 1 overflowed: the shared scale dropped, yet model 2 stepped. "
               "Which of the two optimizers stepped (section 3)?"))
    elif any(t < e for t, e in zip(taken, expected)):
        bug(f"AdamW stepped {taken} times where the batches your loop trained on allow {expected}: "
            "after a skipped step, later steps were skipped too (what is left "
            "in the gradients from one iteration to the next?)")
    elif skipped_by_hand:
        bug(f"GradScaler never saw batch {skipped_by_hand[0]} (the one with the inf): your loop kept it "
            "from the scaler. Let GradScaler find the inf (lesson 03): in a real run you do not know "
            "which batch overflows")
    elif taken == [len(fed)] * len(taken):
        bug(f"not seen yet: no step was skipped (AdamW stepped {taken[0]} of {steps} times), "
            "so the schedulers' guard could not be checked")
    elif any(t > e for t, e in zip(taken, expected)):
        bug(f"AdamW stepped {taken} times where the batches your loop trained on allow {expected}: "
            "some optimizer stepped more than once for one batch (scaler.step(opt) already calls "
            "opt.step() when the step is not skipped)")
    else:
        findings.append(f"fixed: the schedulers stepped {stepped} times, once per step of their own "
                        f"AdamW (GradScaler skipped both at batches {' and '.join(map(str, bad))}, "
                        f"model 1's alone at batch {one_model})")


def _two_model_update_finding(bug, findings, log, batches, fed, steps) -> None:
    """06's exercise: each GradScaler's ``update()``, by its order across batches."""
    counts, scaled, inside, unmatched = _update_order(log, batches.marks)
    updates = counts[0] if len(counts) == 1 else counts
    trained = f"the {len(fed)} batches your loop scaled" if len(fed) < steps else f"{steps} batches"
    if counts != scaled or not fed:
        bug(f"scaler.update() ran {updates} times for {trained}: the scale it changes is the one the "
            "next scaler.step unscales with (section 3)")
    elif inside:
        bug(f"in {len(inside)} of {len(fed)} batches a scaler.update() ran between that batch's scaler.scale "
            "and its last scaler.step: that optimizer's gradients, made at the old scale, were unscaled with "
            "the new one (section 3)")
    elif unmatched:
        bug(f"between batch {unmatched[0]}'s last scaler.step and the next batch's scaler.scale, "
            "scaler.update() did not run exactly once: the scale it changes is the one the next "
            "scaler.step unscales with (section 3)")
    else:
        findings.append(f"fixed: scaler.update() ran once per batch, after its last scaler.step ({updates} "
                        f"times for {trained})")


def _two_model_scaler_finding(bug, findings, log, finite: bool) -> bool:
    """06's exercise: every GradScaler the loop built; True when each is built right. A scaler
    that is off also explains weights that hold inf/NaN, and says so."""
    spoiled = "" if finite else ", and the batches with an inf reached the weights (they now hold inf/NaN)"
    if not log.scalers:
        bug("no GradScaler was built in the loop: the exercise trains in float16, which needs one "
            f"(lesson 03){spoiled}")
        return False
    for s in log.scalers:
        if not s["device_given"]:
            bug("the GradScaler was built without a device: without CUDA it warned and disabled itself, "
                f"so nothing was scaled or skipped (section 8){spoiled}")
            return False
        if not s["enabled"]:
            bug(f"the GradScaler is off (device {s['device']!r}): on this machine it scales nothing "
                f"(section 8){spoiled}")
            return False
    n = len(log.scalers)
    findings.append("fixed: the GradScaler is built for the cpu and is on" if n == 1 else
                    f"fixed: the {n} GradScalers are built for the cpu and are on")
    return True


def check_two_model_loop(loop, steps: int = 4) -> Verdict:
    """06: check the learner's ``loop(models, optimizers, schedulers, batches)`` two ways.

    It is run on two tiny MLPs (AdamW and ``StepLR`` each) for ``steps`` batches, as on a
    machine without CUDA (the same on every machine): the first and the third batch hold an
    inf (both models overflow), and during the fourth model 1's gradient alone holds one. Every
    GradScaler (however imported) and its calls are recorded: the scaler's device, one
    ``update()`` per batch and scaler, after the batch's last ``scaler.step`` and before the
    next batch's ``scaler.scale`` (one scaler per model passes too), each optimizer stepping on every batch its model
    did not overflow, each scheduler stepping exactly when its own optimizer did, no warnings,
    finite weights. Then its source is read by :func:`amp_lessons.lint.check_loop`, whose
    mistakes fail the exercise only when the run found a bug too (else they are notes: the
    run measured what the reading guesses). The findings name the kind of mistake and the
    section that shows it, not the line to write.
    """
    import inspect
    import warnings

    findings, passed = [], True

    def bug(text):
        nonlocal passed
        passed = False
        findings.append(text if text.startswith("not seen yet") else "bug: " + text)

    models = [tiny_model(1), tiny_model(2)]
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
    schedulers = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5) for o in optimizers]
    bad, one_model, error = (0, 2), 3, None  # two skips of both, so a guard that only knows the first is caught
    with without_cuda(), _record_every_scaler() as log, _record_step_order(optimizers, schedulers) as order, \
            warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        batches = _MarkedBatches(tiny_batches(steps, bad=bad), log)
        _overflow_in_model_1(models[0], batches, at=one_model)
        try:
            loop(models, optimizers, schedulers, batches)
        except Exception as err:  # the learner's loop: report it, do not crash the checker
            error = err
    if error is not None:
        bug(f"the loop raised {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}")

    finite = all(torch.isfinite(p).all() for m in models for p in m.parameters())
    scaler_ok = _two_model_scaler_finding(bug, findings, log, finite)

    fed = batches.fed() if log.scalers else None
    if fed is not None:
        _two_model_update_finding(bug, findings, log, batches, fed, steps)

    taken = [optimizer_steps(o) for o in optimizers]
    stepped = [s.last_epoch for s in schedulers]
    warned = any(SCHEDULER_WARNING in str(w.message) for w in caught)
    if fed is None or not _two_model_order_findings(bug, order, len(optimizers)):
        _two_model_schedule_findings(bug, findings, taken, stepped, warned, fed, steps, bad, one_model)
    if scaler_ok and not finite:
        bug("the weights now hold inf/NaN: a batch with an inf reached the optimizers")
    others = sorted({str(w.message) for w in caught if SCHEDULER_WARNING not in str(w.message)})
    findings += [f"warning from your loop: {w}" for w in others]

    try:
        static = check_loop(inspect.getsource(loop))
    except (LintError, OSError, TypeError) as err:
        findings.append(f"(the loop checker could not read your function's source: {err})")
    else:
        ran_right = passed  # every finding of the run above holds: the run decides, check_loop's reading is a note
        for f in static:
            if f.kind == "mistake" and not ran_right:
                passed = False
            kind = f.kind if not ran_right else "note (the run above shows the loop right)"
            findings.append(f"check_loop: a {kind} of the kind lesson {f.lesson[:2]} shows: {f.code}"
                            + (f" ({f.message.split(':')[0]})" if f.kind == "note" else ""))
        if not static:
            findings.append("check_loop finds nothing in your function")
    return Verdict(passed, findings)


# --- 07_beyond_one_device ------------------------------------------------------------


POLICY_STAGES = {
    "sharded": "the sharded parameter, kept between steps",
    "forward": "the parameter in forward (all-gathered)",
    "reduce_scatter": "what the reduce-scatter sends",
    "gradient": "the gradient left in the sharded parameter",
}


def check_policy_prediction(prediction: dict, record: dict) -> Verdict:
    """07: the learner's dtypes for one FSDP2 run, against what its ranks recorded.

    ``prediction`` maps each of :data:`POLICY_STAGES` to a dtype (``torch.bfloat16``,
    ``"fp32"``, ``"half"``, ...) and ``"op"`` to ``"avg"`` or ``"sum"``; ``record`` is one
    rank's record of an ``fsdp_job`` (``run[name][0]``).
    """
    truth = policy_stages(record)
    names = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
    findings, passed = [], True
    if not isinstance(prediction, dict):
        return Verdict(False, ["answer with a dict: {'sharded': ..., 'forward': ..., 'reduce_scatter': ..., "
                               "'gradient': ..., 'op': ...}"])
    unknown = [k for k in prediction if k not in POLICY_STAGES and k != "op"]
    if unknown:
        passed = False
        findings.append(f"unknown key{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}: the keys are "
                        + ", ".join(map(repr, [*POLICY_STAGES, "op"])))
    for key, what in POLICY_STAGES.items():
        said, right = prediction.get(key), names[truth[key]]
        try:
            said = None if said is None else parse_precision(said)
        except ValueError as err:
            passed = False
            findings.append(f"{key}: {err}")
            continue
        if said == right:
            findings.append(f"right: {what} is {truth[key]}")
        else:
            passed = False
            findings.append(f"{key}: {'no answer yet' if said is None else f'not {said}'}; think about {what}"
                            + _POLICY_HINTS[key])
    op = prediction.get("op")
    if op is not None and not isinstance(op, str) and hasattr(op, "name"):  # a torch.distributed.ReduceOp
        op = op.name
    op = op.strip().lower() if isinstance(op, str) else op
    if op == truth["op"]:
        findings.append(f"right: the reduce-scatter op is {op}")
    else:
        passed = False
        if op is None:
            findings.append("op: no answer yet; 'avg' or 'sum'?")
        elif op not in ("avg", "sum"):
            findings.append(f"op: answer 'avg' or 'sum'; got {prediction.get('op')!r}")
        else:
            findings.append(f"op: not {op!r}; compare the largest value of the reduce-scatter's dtype with this "
                            "lesson's 40000 + 40000")
    findings.append(f"(the run: MixedPrecisionPolicy{policy_label(record)})")
    return Verdict(passed, findings)


_POLICY_HINTS = {
    "sharded": ": which copy of the weights does the optimizer step?",
    "forward": ": which field of the policy names the gathered parameters' dtype?",
    "reduce_scatter": ": what does reduce_dtype=None default to in this torch release?",
    "gradient": ": what does the optimizer need to step the sharded parameter?",
}
