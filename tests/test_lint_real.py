"""The loop checker on the patterns of real training code: minimal reproductions of what real
scripts do, each with the findings it must have (often none)."""

import pytest

from amp_lessons.lint import check_loop

# --- correct code that must stay silent -------------------------------------------------------

HALF_THEN_FLOAT = """
model = Model(cfg).to(device)
scaler = torch.amp.GradScaler("cuda", enabled=amp)
model.half().float()  # rounds the anchors, then the weights are float32 again
"""

CLIP_WITHOUT_SCALER_IN_ELSE = """
def finish_step(model, optimizer, scaler, clip):
    if scaler is not None:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        scaler.step(optimizer)
        scaler.update()
    else:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
"""

ACCELERATOR_BACKWARD = """
class Trainer:
    def train_epoch(self, loader):
        for step, batch in enumerate(loader):
            loss = self.model(**batch).loss
            loss = loss / self.accum
            self.accelerator.backward(loss)
            if (step + 1) % self.accum == 0:
                self.optimizer.step()
                self.scheduler.step()
                self.optimizer.zero_grad()
"""

VERSION_FALLBACKS = """
import torch

def make_scaler(device, new_torch):
    return torch.amp.GradScaler(device=device) if new_torch else torch.cuda.amp.GradScaler()

class Scaler:
    def __init__(self, device="cuda"):
        try:
            self._scaler = torch.amp.GradScaler(device=device)
        except (AttributeError, TypeError):
            self._scaler = torch.cuda.amp.GradScaler()
"""

NPU_SCALER = """
import torch_npu
scaler = torch_npu.npu.amp.GradScaler()
"""

ACCUMULATION_BRANCHES = """
for idx, (x, y) in enumerate(loader):
    with torch.autocast("cuda", dtype=torch.float16):
        loss = model(x, y)
    if accum > 1:
        loss_acc = loss / accum
        scaler.scale(loss_acc).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if (idx + 1) % accum == 0:
            scaler.step(optimizer)
            optimizer.zero_grad()
            scaler.update()
    else:
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
"""

PLATEAU_SCHEDULER = """
scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)
for x, y in loader:
    scaler.scale(loss_fn(model(x), y)).backward()
    scaler.step(optimizer)
    scaler.update()
    scheduler.step(val_loss)
"""

NO_SCALER_ELSE_STEP = """
for data in loader:
    optimizer.zero_grad(set_to_none=True)
    model.forward_backward(data)
    if fp16_scaler is not None:
        fp16_scaler.unscale_(optimizer)
        clip_all(model, 3.0)
        fp16_scaler.step(optimizer)
        fp16_scaler.update()
    else:
        optimizer.step()
"""

CUDA_SCALER_CUDA_ONLY_CODE = """
class AMPTrainer:
    def __init__(self):
        self.scaler = torch.amp.GradScaler("cuda")

    def run_step(self):
        assert torch.cuda.is_available(), "CUDA is required for AMP training"
        if torch.cuda.is_available():
            print(torch.cuda.max_memory_allocated())
"""

SCALER_STEP_AND_UPDATE_IN_A_HELPER_CLASS = """
class LossScaler:
    def __init__(self, device):
        self._scaler = torch.amp.GradScaler(device)

    def __call__(self, loss, optimizer, clip_grad=None, parameters=None):
        self._scaler.scale(loss).backward()
        if clip_grad is not None:
            self._scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(parameters, clip_grad)
        self._scaler.step(optimizer)
        self._scaler.update()
"""

SCALER_UPDATE_WITH_A_SCALE = """
def update_params(self, loss):
    self.loss_scaler.scale(loss).backward()
    self.loss_scaler.step(self.optimizer)
    self.loss_scaler.update(self._scale_update_param)
"""

AUTOCAST_FOR_INFERENCE_ONLY = """
def test_autocast(model, inputs):
    with torch.autocast("cuda"):
        return model.inference(inputs)

def test_training(model, x):
    model(x).sum().backward()
"""

AUTOCAST_BY_A_WRAPPER = """
class Benchmark:
    def __init__(self, dtype):
        self.amp_autocast = partial(torch.amp.autocast, device_type="cuda", dtype=dtype)

    def train_step(self, x, y):
        with self.amp_autocast():
            loss = self.loss(self.model(x), y)
        loss.backward()
"""

CORRECT = {
    "autocast for inference, backward in another function": AUTOCAST_FOR_INFERENCE_ONLY,
    "a wrapper of autocast, its dtype a variable": AUTOCAST_BY_A_WRAPPER,
    "model.half().float()": HALF_THEN_FLOAT,
    "a clip in the else: of `if scaler is not None`": CLIP_WITHOUT_SCALER_IN_ELSE,
    "loss / accum, then self.accelerator.backward(loss)": ACCELERATOR_BACKWARD,
    "torch.amp ... if new_torch else torch.cuda.amp ..., and try/except": VERSION_FALLBACKS,
    "torch_npu's GradScaler()": NPU_SCALER,
    "the two arms of `if accum > 1:` are not merged": ACCUMULATION_BRANCHES.replace(
        "        scaler.unscale_(optimizer)\n        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)\n"
        "        if (idx + 1)", "        if (idx + 1)"),
    "ReduceLROnPlateau.step(val_loss)": PLATEAU_SCHEDULER,
    "optimizer.step() in the else: of `if fp16_scaler is not None`": NO_SCALER_ELSE_STEP,
    "a CUDA scaler in code that requires CUDA": CUDA_SCALER_CUDA_ONLY_CODE,
    "scale, unscale_, clip, step, update in a helper class": SCALER_STEP_AND_UPDATE_IN_A_HELPER_CLASS,
    "update(new_scale)": SCALER_UPDATE_WITH_A_SCALE,
}


@pytest.mark.parametrize("name", list(CORRECT))
def test_real_patterns_that_are_right_have_no_findings(name):
    findings = check_loop(CORRECT[name])
    assert not findings, str(findings)


# --- real mistakes that must be found ---------------------------------------------------------

SECOND_STEP = """
for x, y in loader:
    with torch.autocast("cuda", dtype=torch.float16):
        loss = loss_fn(model(x), y)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    optimizer.step()
    optimizer.zero_grad()
"""

FP16_NO_SCALER = """
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
for images, targets in loader:
    with torch.amp.autocast(device_type=str(device)):
        loss = criterion(model(images), targets)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
"""

NO_UPDATE = """
def train(model, device, loader, optimizer, scaler):
    for data, target in loader:
        optimizer.zero_grad()
        with torch.autocast(device.type, dtype=torch.float16):
            loss = F.nll_loss(model(data), target)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
"""

UPDATE_SKIPPED_ON_A_PATH = """
while step < total:
    with torch.autocast("cuda", dtype=torch.float16):
        loss = model(batch)
    scaler.scale(loss).backward()
    skip = False
    scaler.unscale_(optimizer)
    norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
    if norm > limit:
        skip = True
    if not skip:
        scaler.step(optimizer)
        scaler.update()
    optimizer.zero_grad()
"""

CUDA_SCALER_DEVICE_AGNOSTIC = """
device = "cuda" if torch.cuda.is_available() else "cpu"
scaler = torch.cuda.amp.GradScaler()  # amp-lint: ignore[deprecated-amp]
"""

SCALER_ON_ANOTHER_OBJECT = """
def after_backward(runner, model):
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    runner.engine.scaler.unscale_(runner.optimizer)
    runner.engine.scaler.step(runner.optimizer)
    runner.engine.scaler.update()
"""

HELPER_CLIPS_BEFORE_UNSCALE = """
def finish(scaler, opt, model):
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()
"""

SCALER_FLAG_IS_NO_GUARD = """
def step(model, opt, scaler, sched, loss, use_grad_scaler):
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    if use_grad_scaler:
        sched.step()
"""

CONFIG_SKIP_FLAG_IS_NO_GUARD = """
for x, y in loader:
    scaler.scale(loss_fn(model(x), y)).backward()
    scaler.step(opt)
    scaler.update()
    if not args.skip_scheduler:
        scheduler.step()
"""

BROKEN = {  # name: (source, the findings it must have, as codes)
    "optimizer.step() after scaler.step(optimizer)": (SECOND_STEP, ["step-after-scaler-step"]),
    "fp16 autocast (its CUDA default) and no scaler": (FP16_NO_SCALER, ["fp16-without-scaler"]),
    "scaler.step with no update()": (NO_UPDATE, ["missing-update"]),
    "update skipped on one path, unscale_ again": (UPDATE_SKIPPED_ON_A_PATH, ["unscale-twice"]),
    "torch.cuda.amp.GradScaler() in device-agnostic code": (CUDA_SCALER_DEVICE_AGNOSTIC, ["scaler-cuda-only"]),
    "runner.engine.scaler, a clip before its unscale_": (SCALER_ON_ANOTHER_OBJECT, ["clip-before-unscale"]),
    "a helper that clips before unscale_": (HELPER_CLIPS_BEFORE_UNSCALE, ["clip-before-unscale"]),
    "`if use_grad_scaler: sched.step()`": (SCALER_FLAG_IS_NO_GUARD, ["scheduler-unguarded"]),
    "`if not args.skip_scheduler:`": (CONFIG_SKIP_FLAG_IS_NO_GUARD, ["scheduler-unguarded"]),
    "unscale_ every micro-batch, update only on `% accum`": (ACCUMULATION_BRANCHES, ["unscale-twice"]),
}


@pytest.mark.parametrize("name", list(BROKEN))
def test_real_mistakes_are_found(name):
    source, codes = BROKEN[name]
    assert check_loop(source).codes == codes, str(check_loop(source))


def test_accumulation_branches_name_only_the_accumulating_unscale():
    """The else-arm's unscale_ follows its own update() every time: only the arm that
    unscale_s every micro-batch and updates on `% accum` is named."""
    (f,) = check_loop(ACCUMULATION_BRANCHES)
    assert f.line == 8


def test_undecidable_findings_say_may_and_why():
    for source in (FP16_NO_SCALER, CUDA_SCALER_DEVICE_AGNOSTIC):
        (f,) = check_loop(source)
        assert " may " in f.message
    assert "unless a scaler in another file" in check_loop(FP16_NO_SCALER)[0].message
    assert "it asks torch.cuda.is_available() at line 2" in check_loop(CUDA_SCALER_DEVICE_AGNOSTIC)[0].message


def test_deprecated_advice_keeps_the_device():
    (f,) = check_loop("scaler = torch.cuda.amp.GradScaler(enabled=use_amp)\n")
    assert "torch.amp.GradScaler(device.type" in f.message


def test_a_scheduler_guarded_by_the_scale_is_silent():
    guarded = SCALER_FLAG_IS_NO_GUARD.replace(
        "    scaler.step(opt)\n", "    before = scaler.get_scale()\n    scaler.step(opt)\n").replace(
        "if use_grad_scaler:", "if scaler.get_scale() >= before:")
    assert not check_loop(guarded)


def test_the_else_arm_of_an_amp_flag_runs_without_a_scaler():
    source = """
    def run_batch(self, x, y):
        loss = self.model(x, y)
        if self.use_amp:
            self.scaler.scale(loss).backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.optimizer.step()
    """
    (f,) = check_loop(source)
    assert (f.code, f.line) == ("clip-before-unscale", 6)
