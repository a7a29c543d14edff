"""The messages of lesson 06, made on purpose: a minimal loop for each, and its fix.

Used in 06_error_messages. Each loop is a few lines on a tiny MLP (8 -> 16 -> 4) and runs
on the CPU in milliseconds, so the messages come out the same on every machine; the
lesson prints each loop's source and runs it. The broken loops double as test cases for
:func:`amp_lessons.lint.check_loop` (tests/test_lint.py): each has exactly the finding of
its mistake, each fix has none.

Two messages belong to CUDA: ``binary_cross_entropy`` is refused by CUDA autocast (CPU
autocast runs it in float32), and bf16 on a T4 is emulated. On a machine without CUDA the
first is *replayed*: CUDA autocast's real dispatch runs on fake CUDA tensors (lesson 02's
tracer, :func:`amp_lessons.trace.trace_fn` with ``simulate=True``), and the second is
*simulated* by patching the device queries ``torch.cuda.is_bf16_supported`` reads. :func:`selfcheck` (``make gpu-check``)
runs the real thing on a CUDA device, and says which it did.
"""

from __future__ import annotations

import contextlib
import importlib
import warnings
from dataclasses import dataclass
from types import SimpleNamespace

import torch
from torch import nn
from torch.nn import functional as F

from .claims import Verdict, check
from .hardware import hardware_report, pick_device
from .scaling import optimizer_steps
from .trace import trace_fn

DEVICE = torch.device("cpu")  # every reproduction runs here: the same messages on every machine
BCE_MESSAGE = "unsafe to autocast"


def tiny_model(seed: int = 0) -> nn.Sequential:
    """An 8 -> 16 -> 4 MLP with ReLU, built under its own seed (the global RNG is left alone)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def tiny_batches(n: int = 4, size: int = 16, seed: int = 0, bad=()) -> list:
    """``n`` batches ``(x, y)`` of random inputs and 4-class labels; the batches in ``bad``
    hold an inf (a corrupt example), so their fp16 step is skipped."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        x, y = torch.randn(size, 8, generator=g), torch.randint(0, 4, (size,), generator=g)
        if i in bad:
            x[0, 0] = float("inf")
        out.append((x, y))
    return out


def fix_diff(broken, fixed) -> str:
    """The lines that differ between two loops' bodies (``-`` broken, ``+`` fixed), with one
    line of context; the ``def`` lines and docstrings are left out."""
    import difflib
    import inspect

    def body(fn):
        lines = inspect.getsource(fn).splitlines()
        start = next(i for i, line in enumerate(lines) if line.rstrip().endswith('"""') and i > 0) + 1
        return lines[start:]

    out = []
    for line in difflib.unified_diff(body(broken), body(fixed), lineterm="", n=1):
        if not line.startswith(("---", "+++", "@@")):
            out.append(line)
    return "\n".join(out)


# Modules whose threads can warn while a notebook cell runs (a kernel's own housekeeping): a
# warning from them was not raised by the code under test.
_KERNEL_MODULES = ("ipykernel", "jupyter_client", "jupyter_core", "zmq", "tornado", "traitlets",
                   "IPython", "nbclient", "debugpy")


def _raised_by_the_run(w: warnings.WarningMessage) -> bool:
    parts = str(w.filename).replace("\\", "/").split("/")
    return not any(module in parts for module in _KERNEL_MODULES)


def caught_warnings(fn, *args, **kwargs) -> tuple[list[warnings.WarningMessage], object]:
    """Run ``fn`` and return ``(every warning it raised, its result)``; warnings a notebook
    kernel's own threads raise meanwhile are left out (lesson 06)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = fn(*args, **kwargs)
    return [w for w in caught if _raised_by_the_run(w)], result


# --- 1. the lr_scheduler warning -------------------------------------------------------------


def train_stepping_scheduler_always(model, opt, scheduler, batches):
    """Mistake (row 1): the scheduler steps every iteration, also after a skipped step."""
    scaler = torch.amp.GradScaler("cpu")
    for x, y in batches:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        scheduler.step()
        opt.zero_grad(set_to_none=True)


def train_stepping_scheduler_after_real_steps(model, opt, scheduler, batches):
    """Fix (row 1): step the scheduler only when the optimizer stepped (with one optimizer: when
    the scale did not drop).
    ``get_scale()`` copies the scale to the CPU (on CUDA it waits for the GPU), so the loop
    reads it once per step and keeps the last value."""
    scaler = torch.amp.GradScaler("cpu")
    scale = scaler.get_scale()
    for x, y in batches:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        new_scale = scaler.get_scale()  # one read per step
        if new_scale >= scale:  # the step was not skipped
            scheduler.step()
        scale = new_scale
        opt.zero_grad(set_to_none=True)


@dataclass(frozen=True)
class SchedulerRun:
    """What one run of a row-1 loop did: its warnings and the two step counts."""

    warnings: list
    optimizer_steps: int
    scheduler_steps: int
    lr: float

    def __str__(self) -> str:
        return (f"{len(self.warnings)} warning{'s' * (len(self.warnings) != 1)}; AdamW stepped "
                f"{self.optimizer_steps} times, the scheduler {self.scheduler_steps} times; lr now {self.lr:g}")


def scheduler_run(loop, skip_at: int, steps: int = 4, lr: float = 0.01, fused: bool = False) -> SchedulerRun:
    """Run ``loop`` for ``steps`` batches with AdamW (``fused=True``: its fused kernel, whose
    ``step`` GradScaler calls also on a skipped step) and ``StepLR(step_size=1, gamma=0.5)``,
    the batch ``skip_at`` holding an inf (so GradScaler skips that step)."""
    model = tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, fused=fused)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    caught, _ = caught_warnings(loop, model, opt, scheduler, tiny_batches(steps, bad=(skip_at,)))
    return SchedulerRun([str(w.message) for w in caught], optimizer_steps(opt), scheduler.last_epoch,
                        opt.param_groups[0]["lr"])


def state_after_a_skipped_first_step(fused: bool, momentum: float = 0.9) -> list[str]:
    """The state keys SGD (``momentum``; ``fused=True``: its fused kernel) holds for each
    weight after one GradScaler-skipped step, its first (lesson 06, section 1): the fused
    one's ``momentum_buffer`` was made by ``torch.empty_like`` and the kernel skipped, so it
    holds whatever memory it got; the lesson prints the keys only, never those values."""
    model = tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum, fused=fused)
    scaler = torch.amp.GradScaler("cpu")
    (x, y), = tiny_batches(1, bad=(0,))
    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    if scaler.get_scale() >= 2.0**16:
        raise RuntimeError("GradScaler took that step: the batch's inf did not reach the gradients")
    return sorted({k for p in model.parameters() for k in opt.state.get(p, {})})


# --- 2. unscale_ twice --------------------------------------------------------------------


def accumulate_unscaling_every_micro_batch(model, opt, scaler, batches, max_norm, dtype=torch.float16):
    """Mistake (row 2): unscale_ and the clip inside the micro-batch loop, the step after it."""
    device = next(model.parameters()).device
    k = len(batches)
    for x, y in batches:
        with torch.autocast(device.type, dtype=dtype):
            loss = F.cross_entropy(model(x), y) / k  # each micro-batch carries 1/k of the mean
        scaler.scale(loss).backward()  # every micro-batch: gradients add up, all scaled by S
        scaler.unscale_(opt)  # the second micro-batch calls it again before update()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    scaler.step(opt)
    scaler.update()
    opt.zero_grad(set_to_none=True)


class _Fed(list):
    """Batches that note, in ``fed``, the index of each one the loop takes (lesson 06)."""

    def __init__(self, batches, fed: list):
        super().__init__(batches)
        self.fed = fed

    def __iter__(self):
        for i, batch in enumerate(super().__iter__()):
            self.fed.append(i)
            yield batch


def accumulation_run(loop, k: int = 4, fed: list | None = None) -> str:
    """One optimizer step of ``k`` micro-batches with ``loop`` (the signature of
    :func:`amp_lessons.clipping.accumulate`); says what the optimizer and the scaler did.
    ``fed``, a list, receives the index of each micro-batch the loop took, also when it raises."""
    model = tiny_model()
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    loop(model, opt, scaler, _Fed(tiny_batches(k), [] if fed is None else fed), max_norm=1.0)
    moved = any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
    return f"{k} micro-batches, one step: weights changed {moved}, scale {scaler.get_scale():g}"


# --- 3. one scaler, several optimizers ----------------------------------------------------


def step_two_optimizers_updating_each(models, opts, scaler, x, y):
    """Mistake (row 3): two models, two optimizers, one scaler: update() after each step."""
    for opt in opts:
        opt.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = sum(F.cross_entropy(model(x), y) for model in models)
    scaler.scale(loss).backward()
    for opt in opts:
        scaler.step(opt)
        scaler.update()  # the second optimizer is unscaled with the new scale


def step_two_optimizers(models, opts, scaler, x, y):
    """Fix (row 3): scaler.step(opt) for each optimizer, then scaler.update() once."""
    for opt in opts:
        opt.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = sum(F.cross_entropy(model(x), y) for model in models)
    scaler.scale(loss).backward()
    for opt in opts:
        scaler.step(opt)
    scaler.update()


def schedule_two_optimizers_on_the_scale(models, optimizers, schedulers, batches):
    """Mistake (row 3, unseen by :func:`amp_lessons.lint.check_loop`): row 1's fix applied to
    two optimizers on one scaler. The scale drops when either overflows, so both schedulers
    stay put while the other optimizer stepped. Lesson 06, the loop checker."""
    scaler = torch.amp.GradScaler("cpu")
    scale = scaler.get_scale()
    for x, y in batches:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = sum(F.cross_entropy(model(x), y) for model in models)
        scaler.scale(loss).backward()
        for opt in optimizers:
            scaler.step(opt)
        scaler.update()
        new_scale = scaler.get_scale()
        for opt, scheduler in zip(optimizers, schedulers):
            if new_scale >= scale:
                scheduler.step()
            opt.zero_grad(set_to_none=True)
        scale = new_scale


def two_optimizer_run(step, steps: int = 3, init_scale: float = 2.0**10, growth_interval: int = 1,
                      overflow: tuple = ()) -> list:
    """Run ``step`` ``steps`` times on two tiny models with SGD and one
    ``GradScaler(init_scale, growth_interval)``. Per iteration: ``(scale at backward, scale
    after, [gradient applied / true gradient, per model])``, the ratio ``None`` where the
    model's step was skipped (its weights did not move). The true gradient is the one
    backward produced divided by the scale backward ran with, read with a hook.
    ``overflow``: the indices of the models whose gradient holds an inf at the first
    iteration (lesson 06, section 3)."""
    models = [tiny_model(1), tiny_model(2)]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=growth_interval)
    raw, iteration = {}, [0]

    def record(g, p):
        if iteration[0] == 0 and p is first[id(p)]:
            g = g.clone()
            g.view(-1)[0] = float("inf")
        raw[p] = g.detach().clone()
        return g

    first = {}
    for i, m in enumerate(models):
        params = list(m.parameters())
        for p in params:
            first[id(p)] = params[0] if i in overflow else None
            p.register_hook(lambda g, p=p: record(g, p))
    rows = []
    for x, y in tiny_batches(steps):
        scale = scaler.get_scale()
        before = [torch.cat([p.detach().flatten() for p in m.parameters()]) for m in models]
        step(models, opts, scaler, x, y)
        ratios = []
        for m, old in zip(models, before):
            if torch.equal(torch.cat([p.detach().flatten() for p in m.parameters()]), old):
                ratios.append(None)
                continue
            used = torch.cat([p.grad.flatten() for p in m.parameters()])
            true = torch.cat([raw[p].flatten() for p in m.parameters()]) / scale
            ratios.append(float((used[true != 0] / true[true != 0]).median()))
        rows.append((scale, scaler.get_scale(), ratios))
        iteration[0] += 1
    return rows


def describe_two_optimizer_run(rows) -> str:
    """:func:`two_optimizer_run`'s rows as lines of text."""
    def ratio(r):
        return "skipped" if r is None else f"x{r:g}"

    return "\n".join(f"step {i}: backward at scale {s:>6g}, scale after {after:>6g}; applied/true "
                     f"gradient: model 1 {ratio(r[0])}, model 2 {ratio(r[1])}"
                     for i, (s, after, r) in enumerate(rows))


# --- 4. model.half() with a GradScaler ----------------------------------------------------


def train_half_model(model, batches):
    """Mistake (row 4): the model in float16 (model.half()) with a GradScaler."""
    model.half()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    for x, y in batches:
        loss = F.cross_entropy(model(x.half()), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)


def train_recipe(model, batches, dtype=torch.float16):
    """Fix (row 4): the card's recipe in a loop: float32 weights, autocast, a GradScaler."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", enabled=(dtype == torch.float16))
    for x, y in batches:
        with torch.autocast("cpu", dtype=dtype):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
    return opt, scaler


# --- 5. the autocast edge -----------------------------------------------------------------


def head_outside_autocast(body, head, x, dtype=torch.bfloat16):
    """Mistake (row 5): the body under autocast, the head after the with-block."""
    with torch.autocast("cpu", dtype=dtype):
        h = body(x)  # a 16-bit activation
    return head(h)  # float32 weights meet it outside autocast


@contextlib.contextmanager
def without_onednn():
    """Inside, CPU convolutions do not use oneDNN (``torch.backends.mkldnn.enabled`` False),
    as on a CPU where oneDNN takes no bfloat16 (``use_mkldnn`` in
    ``aten/src/ATen/native/Convolution.cpp``), so every CPU prints the native kernel's
    message. Restored on exit (lesson 06, section 5)."""
    saved = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = False
    try:
        yield
    finally:
        torch.backends.mkldnn.enabled = saved


def head_inside_autocast(body, head, x, dtype=torch.bfloat16):
    """Fix (row 5): the whole forward under autocast (or ``head(h.float())`` to keep it float32)."""
    with torch.autocast("cpu", dtype=dtype):
        return head(body(x))


# --- 6. fp16 overflow ---------------------------------------------------------------------


def attention(q, k, v, dtype=torch.float16, scale_first: bool = False):
    """Attention scores ``q @ k.T / sqrt(d)``, softmax, weighted sum, under autocast. The
    scores are divided by sqrt(d) after the matmul (the usual place), or, with
    ``scale_first``, ``q`` is divided before it. Returns ``(scores, weights, output)``."""
    scale = q.shape[-1] ** 0.5
    with torch.autocast("cpu", dtype=dtype):
        scores = (q / scale) @ k.T if scale_first else q @ k.T / scale
        weights = torch.softmax(scores, dim=-1)
        return scores, weights, weights @ v


def masked_scores(q, k, mask, dtype=torch.float16):
    """Mistake (row 6): attention scores under autocast, masked with ``-1e9``, which float16
    cannot hold (its largest magnitude is 65504)."""
    with torch.autocast("cpu", dtype=dtype):
        scores = q @ k.T / q.shape[-1] ** 0.5
        return scores.masked_fill(mask, -1e9)


def masked_scores_fixed(q, k, mask, dtype=torch.float16):
    """Fix (row 6): mask with the most negative value the scores' dtype holds."""
    with torch.autocast("cpu", dtype=dtype):
        scores = q @ k.T / q.shape[-1] ** 0.5
        return scores.masked_fill(mask, torch.finfo(scores.dtype).min)


def overflow_report(scores, weights, output) -> str:
    """Counts of inf and NaN along the attention, and the loss that follows."""
    loss = output.float().pow(2).mean()
    return (f"{scores.dtype}: scores inf {int(scores.isinf().sum())} of {scores.numel()}; weights NaN "
            f"{int(weights.isnan().sum())} of {weights.numel()}; loss finite: {bool(loss.isfinite())}")


# --- 7. torch.cuda.amp is deprecated --------------------------------------------------------


def deprecated_spellings() -> list[tuple[str, str]]:
    """``(spelling, the FutureWarning it raises)`` for the old ``torch.cuda.amp`` / ``torch.cpu.amp``
    spellings. Other warnings (CUDA not available here) are left out: they depend on the machine."""
    makers = {  # on purpose: these lines make the warnings (the checker is told so)
        "torch.cuda.amp.autocast()": lambda: torch.cuda.amp.autocast(),  # amp-lint: ignore[deprecated-amp]
        "torch.cuda.amp.GradScaler()": lambda: torch.cuda.amp.GradScaler(),  # amp-lint: ignore[deprecated-amp]
        "torch.cpu.amp.autocast()": lambda: torch.cpu.amp.autocast(),  # amp-lint: ignore[deprecated-amp]
    }
    out = []
    for spelling, make in makers.items():
        caught, _ = caught_warnings(make)
        future = [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]
        out.append((spelling, future[0] if future else "(no FutureWarning)"))
    return out


def current_spellings_warnings() -> list[str]:
    """The FutureWarnings of the ``torch.amp`` spellings (none)."""
    def build():
        with torch.amp.autocast("cpu", dtype=torch.bfloat16), torch.autocast("cpu", dtype=torch.bfloat16):
            pass
        return torch.amp.GradScaler("cpu")

    caught, _ = caught_warnings(build)
    return [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]


# --- 8. GradScaler() without a device -------------------------------------------------------


@contextlib.contextmanager
def without_cuda():
    """Inside, torch reports no CUDA (``torch.cuda.is_available()`` is False) and no installed
    torch_xla, the two things ``torch.cuda.amp.common.amp_definitely_not_available`` asks
    before CUDA autocast and ``GradScaler("cuda")`` switch off: as on a machine with neither;
    on such a machine it changes nothing. Restored on exit."""
    common = importlib.import_module("torch.cuda.amp.common")  # a module torch does not deprecate
    real_available, real_find_spec = torch.cuda.is_available, common.find_spec
    torch.cuda.is_available = lambda: False
    common.find_spec = lambda name, *args: None if name == "torch_xla" else real_find_spec(name, *args)
    try:
        yield
    finally:
        torch.cuda.is_available, common.find_spec = real_available, real_find_spec


def default_scaler_report() -> str:
    """``torch.amp.GradScaler()`` built as on a machine with neither CUDA nor torch_xla: its warning, whether
    it is enabled, and what ``scale(loss)`` returns."""
    with without_cuda():
        caught, scaler = caught_warnings(torch.amp.GradScaler)
    loss = torch.tensor(0.5)
    said = "; ".join(str(w.message) for w in caught) or "(no warning)"
    return (f"warning: {said}\nenabled: {scaler.is_enabled()}; get_scale(): {scaler.get_scale():g}; "
            f"scale(loss) is loss: {scaler.scale(loss) is loss}")


# --- 9. gradient penalty ------------------------------------------------------------------


def penalty_step(model, opt, scaler, x, y, unscale: bool = True):
    """A gradient-penalty step with a GradScaler, as in PyTorch's AMP examples (row 9).
    ``unscale=False`` forgets to unscale the gradients the penalty is computed from."""
    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.cross_entropy(model(x), y)
    params = list(model.parameters())
    grads = torch.autograd.grad(scaler.scale(loss), params, create_graph=True)  # scaled gradients
    if unscale:
        inv_scale = 1.0 / scaler.get_scale()
        grads = [g * inv_scale for g in grads]  # the penalty needs the true gradients
    with torch.autocast("cpu", dtype=torch.float16):
        penalty = torch.stack([g.pow(2).sum() for g in grads]).sum().sqrt()
        loss = loss + penalty
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad(set_to_none=True)
    return penalty.detach()


@dataclass(frozen=True)
class PenaltyStep:
    """One step of :func:`penalty_run`: the scale it ran at, whether GradScaler skipped it,
    the penalty the loss carried, and the true penalty (the norm of the unscaled gradients of
    the same weights and batch, computed in float32)."""

    scale: float
    skipped: bool
    penalty: float
    true_penalty: float

    @property
    def times_too_large(self) -> float:
        """The penalty the loss carried, over the true one."""
        return self.penalty / self.true_penalty


@dataclass(frozen=True)
class PenaltyRun:
    """:func:`penalty_run`'s steps, and the cross entropy of all its batches after the last one."""

    steps: list
    final_loss: float

    def skipped(self) -> list[int]:
        """The steps GradScaler skipped, counted from 1."""
        return [i + 1 for i, s in enumerate(self.steps) if s.skipped]

    def first_taken(self) -> int:
        """The first step GradScaler took, counted from 1 (0 if it took none)."""
        return next((i + 1 for i, s in enumerate(self.steps) if not s.skipped), 0)


def penalty_run(unscale: bool, steps: int = 24) -> PenaltyRun:
    """:func:`penalty_step` ``steps`` times on the tiny MLP with SGD (lr 0.1), each step's
    true penalty computed beside it (the gradient norm of the plain float32 loss)."""
    model = tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    batches = tiny_batches(steps)
    out = []
    for x, y in batches:
        grads = torch.autograd.grad(F.cross_entropy(model(x), y), list(model.parameters()))
        true = float(torch.stack([g.pow(2).sum() for g in grads]).sum().sqrt())
        scale = scaler.get_scale()
        penalty = float(penalty_step(model, opt, scaler, x, y, unscale=unscale))
        out.append(PenaltyStep(scale, scaler.get_scale() < scale, penalty, true))
    with torch.no_grad():
        xs, ys = torch.cat([x for x, _ in batches]), torch.cat([y for _, y in batches])
        final = float(F.cross_entropy(model(xs), ys))
    return PenaltyRun(out, final)


# --- 10. binary_cross_entropy: CPU runs it, CUDA refuses it -----------------------------------


def bce_under_autocast(dtype=torch.bfloat16) -> str:
    """``F.binary_cross_entropy(sigmoid(logits), y)`` under CPU autocast: the dtypes it ran in."""
    model = nn.Linear(8, 1)
    x, y = torch.randn(16, 8), torch.randint(0, 2, (16, 1)).float()
    with torch.autocast("cpu", dtype=dtype):
        p = torch.sigmoid(model(x))
        loss = F.binary_cross_entropy(p, y)
    return f"probabilities {p.dtype}, loss {loss.dtype}"


def _bce(logits, y):
    return F.binary_cross_entropy(torch.sigmoid(logits), y)


def _bce_with_logits(logits, y):
    return F.binary_cross_entropy_with_logits(logits, y)


def cuda_bce(loss: str = "bce", real: bool = False) -> str:
    """What CUDA autocast (float16) does with ``loss`` ("bce": ``binary_cross_entropy`` of
    sigmoid probabilities; "logits": ``binary_cross_entropy_with_logits``): ``"RuntimeError:
    ..."`` or the loss's dtype. ``real=True`` runs on this machine's GPU; otherwise CUDA
    autocast is replayed here by lesson 02's tracer (:func:`amp_lessons.trace.trace_fn` with
    ``simulate=True``: CUDA autocast's real dispatch on fake CUDA tensors, no GPU, no values)."""
    fns = {"bce": _bce, "logits": _bce_with_logits}
    if loss not in fns:
        raise ValueError(f"loss must be 'bce' or 'logits'; got {loss!r}")
    device = "cuda" if real else "cpu"
    logits, y = torch.zeros(16, 1, device=device), torch.ones(16, 1, device=device)
    try:
        trace = trace_fn(fns[loss], logits, y, device="cuda", dtype=torch.float16, simulate=not real)
    except RuntimeError as err:
        return f"RuntimeError: {err}"
    return f"ran: loss {trace.result.dtype}"


def cuda_bce_raises(device=None) -> Verdict:
    """The verdict on "CUDA autocast refuses binary_cross_entropy (unsafe to autocast)":
    on a CUDA device the real thing (and the replay, which must say the same); elsewhere the
    replay on fake CUDA tensors, and the verdict says so."""
    dev = pick_device(device)
    replay = cuda_bce("bce")
    claim = "CUDA autocast refuses binary_cross_entropy ('unsafe to autocast') and runs BCEWithLogits"
    logits_ok = cuda_bce("logits", real=dev.type == "cuda") == "ran: loss torch.float32"
    if dev.type == "cuda":
        real = cuda_bce("bce", real=True)
        return check(claim, BCE_MESSAGE in real and real == replay and logits_ok,
                     f"run on {dev}; the replay said the same: {real == replay}")
    return check(claim, BCE_MESSAGE in replay and logits_ok,
                 "replayed on fake CUDA tensors: this machine has no CUDA")


# --- 11. bf16 on a T4 ---------------------------------------------------------------------


@contextlib.contextmanager
def simulated_t4():
    """Inside, torch's device queries answer as on Colab's T4 (compute capability 7.5), and
    the test that makes a bf16 tensor on the GPU is replaced by its answer there (True: a T4
    holds one); ``torch.cuda.is_bf16_supported`` itself runs unpatched. Restored on exit."""
    with simulated_gpu(7, 5, "Tesla T4", bf16_tensors=True) as props:
        yield props


@contextlib.contextmanager
def simulated_gpu(major: int, minor: int, name: str, bf16_tensors: bool):
    """Inside, torch's device queries answer as one CUDA GPU of compute capability
    ``(major, minor)`` would, ``bf16_tensors`` saying whether a bfloat16 tensor can be made on
    it (the test ``is_bf16_supported`` makes below 8.0). Restored on exit."""
    props = SimpleNamespace(major=major, minor=minor, name=name, total_memory=15 * 2**30)
    patches = {
        "is_available": lambda: True,
        "device_count": lambda: 1,
        "current_device": lambda: 0,
        "get_device_properties": lambda device=None: props,
        "_check_bf16_tensor_supported": lambda device=None: bf16_tensors,
    }
    saved = {name: getattr(torch.cuda, name) for name in patches}
    try:
        for name, fn in patches.items():
            setattr(torch.cuda, name, fn)
        yield props
    finally:
        for name, fn in saved.items():
            setattr(torch.cuda, name, fn)


def t4_bf16_answers() -> dict:
    """On a simulated T4: what ``is_bf16_supported()`` says with and without emulation, and
    what the course's hardware report makes of it."""
    with simulated_t4():
        report = hardware_report("cuda")
        return {
            "torch.cuda.is_bf16_supported()": torch.cuda.is_bf16_supported(),
            "torch.cuda.is_bf16_supported(including_emulation=False)":
                torch.cuda.is_bf16_supported(including_emulation=False),
            "report: bfloat16": dict(report.rows())["bfloat16"],
            "report: recommended precision": dict(report.rows())["recommended precision"],
        }


def t4_bf16_verdict(device=None) -> Verdict:
    """The verdict on "a T4 says bf16 is supported only by emulation": real on a pre-Ampere
    CUDA GPU, simulated elsewhere (and labelled so)."""
    dev = pick_device(device)
    claim = "a pre-Ampere GPU reports bf16 only through emulation, and the course recommends fp16 there"
    if dev.type == "cuda" and torch.cuda.get_device_capability(dev) < (8, 0):
        report = hardware_report(dev)
        holds = (torch.cuda.is_bf16_supported() and not report.bf16_native
                 and report.recommended == "fp16")
        return check(claim, holds, f"run on {torch.cuda.get_device_name(dev)}")
    answers = t4_bf16_answers()
    holds = (answers["torch.cuda.is_bf16_supported()"]
             and not answers["torch.cuda.is_bf16_supported(including_emulation=False)"]
             and answers["report: recommended precision"].startswith("fp16"))
    return check(claim, holds, "simulated T4 (compute capability 7.5): this machine has no pre-Ampere GPU")


# --- 12. three more messages ---------------------------------------------------------------


def train_alternating_stepping_both(models, opts, batches):
    """Mistake (row 12a): two models trained in turn (a GAN's two halves, say), one scaler;
    every iteration steps both optimizers, though only one model had a backward."""
    scaler = torch.amp.GradScaler("cpu")
    for i, (x, y) in enumerate(batches):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(models[i % 2](x), y)  # this iteration trains one model
        scaler.scale(loss).backward()
        for opt in opts:
            scaler.step(opt)  # the other optimizer's parameters have no gradients
        scaler.update()
        for opt in opts:
            opt.zero_grad(set_to_none=True)


def train_alternating(models, opts, batches):
    """Fix (row 12a): step only the optimizer of the model whose loss went backward."""
    scaler = torch.amp.GradScaler("cpu")
    for i, (x, y) in enumerate(batches):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(models[i % 2](x), y)  # this iteration trains one model
        scaler.scale(loss).backward()
        scaler.step(opts[i % 2])
        scaler.update()
        opts[i % 2].zero_grad(set_to_none=True)


def alternating_run(loop, steps: int = 4) -> str:
    """``loop`` on two tiny models with SGD: how many times each model's weights moved."""
    models = [tiny_model(1), tiny_model(2)]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    counts = [0, 0]
    for j, opt in enumerate(opts):
        opt.register_step_post_hook(lambda *_, j=j: counts.__setitem__(j, counts[j] + 1))
    loop(models, opts, tiny_batches(steps))
    return f"{steps} iterations: model 1 stepped {counts[0]} times, model 2 {counts[1]} times"


def weighted_loss_of_bf16_model(model, x, y, class_weights):
    """Mistake (row 12b): the model cast to bfloat16 (``model.to(torch.bfloat16)``), and a
    float32 class-weight tensor in the loss."""
    model.to(torch.bfloat16)
    return F.cross_entropy(model(x.to(torch.bfloat16)), y, weight=class_weights)


def weighted_loss_under_autocast(model, x, y, class_weights):
    """Fix (row 12b): float32 weights and autocast, which runs ``cross_entropy`` in float32."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return F.cross_entropy(model(x), y, weight=class_weights)


def bf16_autocast_on_gpu_without_bf16() -> None:
    """``torch.autocast("cuda", dtype=torch.bfloat16)`` on a simulated GPU below compute
    capability 8.0 on which no bfloat16 tensor can be made: its constructor raises (row 12c)."""
    with simulated_gpu(6, 0, "a pre-Ampere GPU that cannot hold bfloat16", bf16_tensors=False):
        torch.autocast("cuda", dtype=torch.bfloat16)


# --- the GPU self-check ---------------------------------------------------------------------


def default_scaler_verdict(device=None) -> Verdict:
    """The verdict on "GradScaler() means 'cuda': enabled where CUDA is, off (with a warning) where not"."""
    dev = pick_device(device)
    with without_cuda():
        caught, off = caught_warnings(torch.amp.GradScaler)
    holds = not off.is_enabled() and any("CUDA is not available" in str(w.message) for w in caught)
    figures = "without CUDA: disabled, with its warning"
    if dev.type == "cuda":
        caught, on = caught_warnings(torch.amp.GradScaler)
        holds = holds and on.is_enabled() and not caught
        figures += f"; on {dev}: enabled, no warning"
    return check("GradScaler() without a device is a CUDA scaler: off, with a warning, where there is no CUDA",
                 holds, figures)


def selfcheck(device=None) -> list[Verdict]:
    """Lesson 06's statements about devices, checked on ``device`` (``make gpu-check``):
    binary_cross_entropy under CUDA autocast, bf16 on a T4, GradScaler() without a device."""
    return [cuda_bce_raises(device), t4_bf16_verdict(device), default_scaler_verdict(device)]
