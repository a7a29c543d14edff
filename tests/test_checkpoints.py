"""Checkpoints that never load silently wrong: a digest of the contents, and every value checked.

References: the state of the trainer that saved the file, and the state of the trainer that
loads it, compared value by value and bit by bit (floats by repr, tensors by their bytes).
"""

import collections
import math
import os
import pickle
import random
import re
import zipfile

import numpy as np
import pytest
import torch

from amp_lessons.checkpoints import CheckpointError, checkpoint_digest, settings_differences
from amp_lessons.data import Dataset, digits
from amp_lessons.models import mlp
from amp_lessons.seeding import rng_state
from amp_lessons.training import ScaleCollapseError, Trainer

DATA = digits()


def step_lr(opt):
    return torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)


def trainer(model_seed=0, hidden=32, **kwargs):
    """An fp16 run with Adam and a StepLR schedule; ``model_seed`` picks the starting weights
    (another state of the same run), ``kwargs`` change its settings."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(model_seed)
        model = mlp(64, hidden, 10, depth=2)
    kwargs = {"precision": "fp16", "optimizer": "adam", "lr": 1e-3, "batch_size": 32,
              "init_scale": 2.0**10, "scheduler": step_lr, "progress": False, **kwargs}
    return Trainer(model, DATA, device="cpu", **kwargs)


def canonical(obj):
    """``obj`` as nested tuples that compare exactly: tensors by dtype, shape and bytes, floats
    by repr (so NaN equals NaN and -0.0 differs from 0.0)."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous().reshape(-1)
        return ("tensor", str(obj.dtype), tuple(obj.shape), t.view(torch.uint8).numpy().tobytes())
    if isinstance(obj, np.ndarray):
        return ("array", str(obj.dtype), obj.tobytes())
    if isinstance(obj, dict):
        return ("dict", tuple((canonical(k), canonical(v)) for k, v in obj.items()))
    if isinstance(obj, (list, tuple)):
        return (type(obj).__name__, tuple(canonical(v) for v in obj))
    if isinstance(obj, float):
        return ("float", repr(obj))
    return (type(obj).__name__, obj)


def full_state(t):
    """Everything a checkpoint restores, and the global RNG states it sets."""
    return canonical({
        "model": t.model.state_dict(), "optimizer": t.optimizer.state_dict(),
        "scaler": t.scaler.state_dict(), "scale": t.current_scale(),
        "scheduler": t.scheduler.state_dict() if t.scheduler is not None else None,
        "step": t.step_count, "history": t.history.as_dicts(), "rng": rng_state(),
    })


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A checkpoint of an fp16 run with Adam, a scheduler and a skipped step, and the state it holds."""
    t = trainer(inject_nonfinite=(1,))
    t.fit(5)
    path = t.save(tmp_path_factory.mktemp("ckpt") / "run.pt")
    return path, full_state(t)


@pytest.fixture(scope="module")
def other(tmp_path_factory):
    """A trainer of the same model in another state, and a checkpoint of that state to reset it."""
    target = trainer(model_seed=3, inject_nonfinite=(1,))
    target.fit(2)
    return target, target.save(tmp_path_factory.mktemp("other") / "other.pt")


def loaded_or_refused(path, expected, other):
    """Load ``path`` into a trainer in another state: ``"restored"`` (exactly ``expected``) or
    ``"refused"`` (CheckpointError, the trainer exactly as it was). Anything else fails."""
    target, reset = other
    target.load(reset)
    before = full_state(target)
    assert before != expected
    try:
        target.load(path)
    except CheckpointError as err:
        assert full_state(target) == before, f"refused ({err}) but changed the trainer"
        return "refused", str(err)
    assert full_state(target) == expected, "loaded something other than what was saved"
    return "restored", ""


def test_a_checkpoint_restores_exactly_what_was_saved(saved, other):
    path, expected = saved
    assert loaded_or_refused(path, expected, other) == ("restored", "")
    other[0].fit(1)  # and it trains on


def test_random_flipped_bytes_are_refused_or_restore_exactly_100_times(saved, other, tmp_path):
    path, expected = saved
    raw = path.read_bytes()
    rng = random.Random(14)
    outcomes, reasons = collections.Counter(), collections.Counter()
    for _ in range(100):
        data = bytearray(raw)
        for _ in range(rng.choice((1, 1, 8, 64))):
            data[rng.randrange(len(data))] ^= rng.randrange(1, 256)
        flipped = tmp_path / "flipped.pt"
        flipped.write_bytes(bytes(data))
        outcome, message = loaded_or_refused(flipped, expected, other)
        outcomes[outcome] += 1
        if outcome == "refused":
            reasons["digest" if "digest" in message else "other"] += 1
            assert_one_clear_message(message)
    assert outcomes["refused"] + outcomes["restored"] == 100
    # most flips do damage, and many of them torch.load alone would have let through
    assert outcomes["refused"] >= 80 and reasons["digest"] >= 30, (outcomes, reasons)


def tensor_records(path):
    """(name, first byte, size) of every tensor's bytes inside the checkpoint's zip archive."""
    with zipfile.ZipFile(path) as z:
        out = []
        for info in z.infolist():
            if "/data/" in info.filename:
                with open(path, "rb") as f:  # the data follows the local header and its extra field
                    f.seek(info.header_offset + 26)
                    name_len, extra_len = (int.from_bytes(f.read(2), "little") for _ in range(2))
                out.append((info.filename, info.header_offset + 30 + name_len + extra_len, info.file_size))
        return out


def test_flipped_bytes_inside_any_tensor_are_caught_by_the_digest(saved, other, tmp_path):
    """The issue's case: 64 bytes flipped inside Adam's state loaded as NaN. torch.load reads
    tensor bytes without a checksum; the digest is what refuses them, for every tensor."""
    path, expected = saved
    raw = path.read_bytes()
    records = tensor_records(path)
    assert len(records) >= 10  # weights, Adam's moments and steps, the RNG states
    for name, start, size in records:
        data = bytearray(raw)
        for i in range(start, start + min(size, 64)):
            data[i] ^= 0xFF
        flipped = tmp_path / "flipped.pt"
        flipped.write_bytes(bytes(data))
        outcome, message = loaded_or_refused(flipped, expected, other)
        assert outcome == "refused" and "its digest does not match its contents" in message, name


# -- values that no run can hold, in a file whose digest is intact ---------------------------


def resigned(path, tmp_path, change):
    """A copy of the checkpoint at ``path`` with ``change(state)`` applied and the digest recomputed,
    as a tool that edits checkpoints would write it."""
    state = torch.load(path, weights_only=True)
    change(state)
    state["digest"] = checkpoint_digest(state)
    out = tmp_path / "edited.pt"
    torch.save(state, out)
    return out


def first_param_state(state):
    return state["optimizer"]["state"][0]


def set_group(key, value):
    def change(state):
        state["optimizer"]["param_groups"][0][key] = value
    return change


BAD_VALUES = {
    "nan weights": (lambda s: s["model"]["0.weight"].view(-1)[:3].fill_(math.nan),
                    "model tensor '0.weight' holds 3 inf/NaN values"),
    "inf bias": (lambda s: s["model"]["2.bias"].fill_(math.inf), "model tensor '2.bias' holds 32 inf/NaN"),
    "weight of another dtype": (lambda s: s["model"].__setitem__("0.bias", s["model"]["0.bias"].double()),
                                "model tensor '0.bias' is torch.float64 of shape [32]; the model's is "
                                "torch.float32"),
    "nan exp_avg_sq": (lambda s: first_param_state(s)["exp_avg_sq"].view(-1)[0].fill_(math.nan),
                       "the optimizer's 'exp_avg_sq' of parameter 0 holds 1 inf/NaN value"),
    "negative exp_avg_sq": (lambda s: first_param_state(s)["exp_avg_sq"].view(-1)[0].fill_(-1.0),
                            "holds negative values; a mean of squares is >= 0"),
    "exp_avg of another shape": (lambda s: first_param_state(s).__setitem__("exp_avg", torch.zeros(3)),
                                 "the optimizer's 'exp_avg' of parameter 0 has shape [3]"),
    "negative adam step": (lambda s: first_param_state(s)["step"].fill_(-5.0),
                           "the optimizer's 'step' of parameter 0 is -5.0; a step count is an integer >= 0"),
    "nan lr": (set_group("lr", math.nan), "the optimizer's lr (param group 0) is nan; it must be a finite"),
    "zero initial_lr": (set_group("initial_lr", 0.0), "initial_lr (param group 0) is 0.0; a learning rate"),
    "negative lr": (set_group("lr", -1e-3), "the optimizer's lr (param group 0) is -0.001; a learning rate must"),
    "beta of 1": (set_group("betas", (0.9, 1.0)), "each beta must lie in [0, 1)"),
    "negative eps": (set_group("eps", -1e-8), "the optimizer's eps (param group 0) is -1e-08; it must be >= 0"),
    "negative step": (lambda s: s.__setitem__("step", -5), "its step count is -5; it must be an integer >= 0"),
    "history of another length": (lambda s: s["history"].pop(), "its history holds 4 records for 5 steps"),
    "history longer than the run": (lambda s: s["history"].append(dict(s["history"][-1], step=5)),
                                    "its history holds 6 records for 5 steps"),
    "scale 0": (lambda s: s["scaler"].__setitem__("scale", 0.0),
                "its GradScaler state is invalid: the loss scale must be a positive finite number; got 0.0"),
    "scale below the floor": (lambda s: s["scaler"].__setitem__("scale", 1e-6),
                              "holds a loss scale of 1e-06, below this trainer's floor min_scale=6.1e-05"),
    "scale inf": (lambda s: s["scaler"].__setitem__("scale", math.inf), "the loss scale must be a positive"),
    "backoff 1": (lambda s: s["scaler"].__setitem__("backoff_factor", 1.0), "backoff_factor must be between"),
    "growth tracker": (lambda s: s["scaler"].__setitem__("_growth_tracker", 5000),
                       "its count of clean steps is 5000"),
    "nan scheduler lr": (lambda s: s["scheduler"]["_last_lr"].__setitem__(0, math.nan),
                         "its lr scheduler state['_last_lr'][0] is nan"),
    "rng": (lambda s: s["rng"].__setitem__("torch", torch.zeros(3, dtype=torch.uint8)),
            "its random number generator states are invalid"),
    "python rng": (lambda s: s["rng"].__setitem__("python", (3, (1, 2), None)),
                   "its random number generator states are invalid"),
}


@pytest.mark.parametrize("case", list(BAD_VALUES))
def test_values_no_run_can_hold_are_refused_naming_them(saved, other, tmp_path, case):
    path, expected = saved
    change, message = BAD_VALUES[case]
    outcome, got = loaded_or_refused(resigned(path, tmp_path, change), expected, other)
    assert outcome == "refused" and message in got, got


def test_scale_zero_is_a_checkpoint_error_not_a_scale_collapse(saved, tmp_path):
    """Before: it loaded, then the next step raised ScaleCollapseError 'after 0 skipped steps'."""
    path, _ = saved
    t = trainer(model_seed=3, inject_nonfinite=(1,))
    with pytest.raises(CheckpointError, match="the loss scale must be a positive finite number; got 0.0"):
        t.load(resigned(path, tmp_path, BAD_VALUES["scale 0"][0]))
    try:
        t.fit(1)
    except ScaleCollapseError:  # pragma: no cover - the bug this test guards against
        pytest.fail("the scale of the refused checkpoint reached the trainer")


def test_a_changed_file_without_a_new_digest_is_corrupt(saved, other, tmp_path):
    path, expected = saved
    state = torch.load(path, weights_only=True)
    state["history"][2]["loss"] = 0.5  # a plausible value: only the digest can tell
    torch.save(state, tmp_path / "edited.pt")
    outcome, message = loaded_or_refused(tmp_path / "edited.pt", expected, other)
    assert outcome == "refused" and "is corrupt" in message


def test_a_checkpoint_of_the_earlier_format_says_to_save_again(saved, other, tmp_path):
    path, expected = saved
    state = torch.load(path, weights_only=True)
    state["format"] = "amp-lessons-checkpoint/1"
    del state["digest"]
    torch.save(state, tmp_path / "old.pt")
    outcome, message = loaded_or_refused(tmp_path / "old.pt", expected, other)
    assert outcome == "refused" and "another format ('amp-lessons-checkpoint/1'" in message
    assert "save it with this version" in message


def test_a_run_that_diverged_is_not_saved(tmp_path):
    t = trainer()
    t.fit(2)
    with torch.no_grad():
        t.model[0].weight[0, 0] = math.nan
    with pytest.raises(CheckpointError, match="refusing to save: model tensor '0.weight' holds 1 inf/NaN value"):
        t.save(tmp_path / "diverged.pt")
    assert not list(tmp_path.iterdir())  # nothing written, not even the temporary file


def test_a_schedule_that_ends_at_lr_0_saves_and_resumes(tmp_path):
    """CosineAnnealingLR with eta_min=0 reaches lr 0: a real run, so a valid checkpoint."""
    def cosine(opt):
        return torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=3)

    t = trainer(scheduler=cosine)
    t.fit(3)
    assert t.optimizer.param_groups[0]["lr"] == 0.0
    other = trainer(model_seed=3, scheduler=cosine)
    other.load(t.save(tmp_path / "cosine.pt"))
    assert full_state(other) == full_state(t)


def test_the_digest_sees_every_kind_of_value():
    base = {"a": [1, 2.0, True, None, "x"], "t": torch.zeros(3)}
    variants = [
        {"a": [1, 2.0, True, None, "x"], "t": torch.zeros(3, dtype=torch.float64)},  # dtype
        {"a": [1, 2.0, True, None, "x"], "t": torch.zeros(1, 3)},  # shape
        {"a": [1, 2.0, True, None, "x"], "t": torch.tensor([0.0, -0.0, 0.0])},  # one bit
        {"a": [1.0, 2.0, True, None, "x"], "t": torch.zeros(3)},  # 1 vs 1.0
        {"a": [1, 2.0, 1, None, "x"], "t": torch.zeros(3)},  # True vs 1
        {"a": (1, 2.0, True, None, "x"), "t": torch.zeros(3)},  # list vs tuple
        {"a": [1, 2.0, True, None, "y"], "t": torch.zeros(3)},
        {"t": torch.zeros(3), "a": [1, 2.0, True, None, "x"]},  # order
    ]
    digests = {checkpoint_digest(v) for v in variants}
    assert len(digests) == len(variants) and checkpoint_digest(base) not in digests
    assert checkpoint_digest(base) == checkpoint_digest({**base, "digest": "anything"})
    with pytest.raises(TypeError, match="a checkpoint holds only"):
        checkpoint_digest({"f": print})


def test_the_digest_sees_every_dict_key():
    """A key renamed, or of another type, with the same value: another digest."""
    base = checkpoint_digest({"a": 1, "b": torch.zeros(2)})
    for variant in ({"c": 1, "b": torch.zeros(2)}, {"a": 1, "bb": torch.zeros(2)}, {1: 1, "b": torch.zeros(2)},
                    {"a": 1, "b": {"x": torch.zeros(2)}}, {"a": 1, "b": {"y": torch.zeros(2)}}):
        assert checkpoint_digest(variant) != base, variant
    assert checkpoint_digest({"k": {"x": 1}}) != checkpoint_digest({"k": {"y": 1}})


# -- one clear message for every kind of damage ------------------------------------------------

PROBLEMS = ("does not exist", "is a directory", "is empty", "is not a checkpoint of this course", "is truncated",
            "is damaged", "is corrupt: its digest does not match", "is malformed", "cannot be resumed",
            "is an incomplete checkpoint", "is a checkpoint of another format")


def assert_one_clear_message(message):
    """What is wrong (one of PROBLEMS), that nothing was changed, and what to do; never torch's
    advice to load unsafely, never an OS error number as the explanation."""
    assert sum(p in message for p in PROBLEMS) >= 1, message
    assert "Nothing was changed;" in message and message.count("\n") == 0, message
    assert "weights_only" not in message and "Errno" not in message and "pickle" not in message.lower(), message


class RunsCode:
    """A pickle that would create a folder if it were loaded without weights_only."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.makedirs, (self.marker,))


def corrupted_files(saved_path, tmp_path):
    """(name, path) of damaged and foreign files: truncations at many offsets, flipped bytes,
    files torch.save wrote of other things, a pickle that would run code, empty, a folder."""
    raw = saved_path.read_bytes()
    out = []

    def write(name, data):
        path = tmp_path / f"{name}.pt"
        path.write_bytes(data)
        out.append((name, path))

    for k in range(40):
        cut = 1 + k * (len(raw) - 2) // 39
        write(f"truncated at {cut}", raw[:cut])
    rng = random.Random(26)
    for _ in range(30):
        data = bytearray(raw)
        start = rng.randrange(len(raw) - 16)
        for i in range(start, start + rng.choice((1, 4, 16))):
            data[i] ^= 0xFF
        write(f"flipped at {start}", bytes(data))
    write("empty", b"")
    write("text", b"not a checkpoint\n")
    write("python dump", pickle.dumps({"format": "amp-lessons-checkpoint/3"}))
    with zipfile.ZipFile(tmp_path / "other.zip", "w") as z:
        z.writestr("hello.txt", "hi")
    out.append(("a zip of something else", tmp_path / "other.zip"))
    for name, obj in (("foreign dict", {"weights": torch.ones(3)}), ("a tensor", torch.ones(3)),
                      ("a list", [1, 2]), ("runs code", RunsCode(tmp_path / "code_ran"))):
        torch.save(obj, tmp_path / f"{name}.pt")
        out.append((name, tmp_path / f"{name}.pt"))
    (tmp_path / "a folder").mkdir()
    out.append(("a folder", tmp_path / "a folder"))
    out.append(("missing", tmp_path / "missing.pt"))
    return out


def test_every_corruption_is_refused_with_one_clear_message_or_loads_exactly(saved, other, tmp_path):
    path, expected = saved
    outcomes, problems = collections.Counter(), collections.Counter()
    for name, bad in corrupted_files(path, tmp_path):
        outcome, message = loaded_or_refused(bad, expected, other)
        outcomes[outcome] += 1
        if outcome == "refused":
            assert_one_clear_message(message)
            problems[next(p for p in PROBLEMS if p in message)] += 1
        else:
            assert name.startswith("flipped"), name  # a flip in bytes nothing reads back
    assert not (tmp_path / "code_ran").exists()  # the pickle's code never ran
    assert outcomes["refused"] >= 70 and outcomes["refused"] + outcomes["restored"] == 80, outcomes
    assert problems["is truncated"] >= 35 and problems["is not a checkpoint of this course"] >= 6, problems


# -- resume: exact, at every step ----------------------------------------------------------------


def exact_run(model_seed=0):
    """Six steps with everything that can go wrong on resume: fp16 and a GradScaler that grows
    and halves (a skip at step 2), accumulation over 3 micro-batches, a clip, a schedule."""
    return trainer(model_seed=model_seed, accum_steps=3, batch_size=16, clip_norm=1.0, growth_interval=2,
                   inject_nonfinite=(2,))


def state_without_times(t):
    history = [{k: v for k, v in r.items() if k != "ms"} for r in t.history.as_dicts()]
    return canonical({
        "model": t.model.state_dict(), "optimizer": t.optimizer.state_dict(), "scaler": t.scaler.state_dict(),
        "scheduler": t.scheduler.state_dict(), "step": t.step_count, "history": history, "rng": rng_state(),
    })


def test_resuming_at_every_step_continues_the_run_bit_for_bit(tmp_path):
    whole = exact_run()
    whole.fit(6)
    expected = state_without_times(whole)
    assert whole.history.skipped == 1 and whole.current_scale() != 2.0**10
    for k in range(7):
        first = exact_run()
        if k:
            first.fit(k)
        resumed = exact_run(model_seed=5).load(first.save(tmp_path / f"at_{k}.pt"))  # other weights
        assert resumed.step_count == k
        if k < 6:
            resumed.fit(6 - k)
        assert state_without_times(resumed) == expected, f"resumed after step {k}"


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
@pytest.mark.parametrize("scheduler", [None, step_lr])
def test_resuming_from_a_checkpoint_equals_an_uninterrupted_run(tmp_path, precision, scheduler):
    kwargs = {"precision": precision, "scheduler": scheduler, "growth_interval": 2,
              "inject_nonfinite": (2, 7) if precision == "fp16" else ()}
    whole = trainer(**kwargs)
    whole.fit(10)
    first = trainer(**kwargs)
    first.fit(5)
    resumed = trainer(model_seed=1, **kwargs).load(first.save(tmp_path / "run.pt"))
    resumed.fit(5)
    assert full_state_without_times(whole) == full_state_without_times(resumed)


def full_state_without_times(t):
    history = [{k: v for k, v in r.items() if k != "ms"} for r in t.history.as_dicts()]
    return canonical({"model": t.model.state_dict(), "optimizer": t.optimizer.state_dict(),
                      "scaler": t.scaler.state_dict(), "history": history,
                      "scheduler": t.scheduler.state_dict() if t.scheduler is not None else None})


# -- resume into a differently built Trainer: refused, naming each difference -------------------


def gamma_09(opt):
    return torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.9)


def other_loss(out, y):
    return torch.nn.functional.cross_entropy(out, y, label_smoothing=0.1)


DIFFERENT_RUNS = {
    "seed": ({"seed": 1}, "seed: saved 0, this trainer 1", "seed="),
    "batch size": ({"batch_size": 16}, "batch_size: saved 32, this trainer 16", "batch_size="),
    "accumulation": ({"accum_steps": 2}, "accum_steps: saved 1, this trainer 2", "accum_steps="),
    "clip": ({"clip_norm": 0.5}, "clip_norm: saved None, this trainer 0.5", "clip_norm="),
    "clip order": ({"clip_norm": None, "clip_order": "before_unscale", "teaching": True},
                   "clip_order: saved 'unscale_first', this trainer 'before_unscale'", "clip_order="),
    "no scheduler": ({"scheduler": None}, "scheduler.type: saved 'StepLR', this trainer None", "scheduler="),
    "another gamma": ({"scheduler": gamma_09}, "scheduler.as_built.gamma: saved 0.5, this trainer 0.9", "scheduler="),
    "precision": ({"precision": "bf16"}, "precision: saved 'fp16', this trainer 'bf16'", "precision="),
    "no scaler": ({"scaler": False, "teaching": True}, "scaler.enabled: saved True, this trainer False", "scaler="),
    "growth interval": ({"growth_interval": 5}, "scaler.growth_interval: saved 2000, this trainer 5", "scaler="),
    "backoff": ({"backoff_factor": 0.25}, "scaler.backoff_factor: saved 0.5, this trainer 0.25", "scaler="),
    "floor": ({"min_scale": 1e-6}, "min_scale: saved 6.103515625e-05, this trainer 1e-06", "min_scale="),
    "optimizer": ({"optimizer": "sgd"}, "optimizer.type: saved 'Adam', this trainer 'SGD'", "optimizer= and lr="),
    "lr": ({"lr": 0.01}, "optimizer.groups[0].lr: saved 0.001, this trainer 0.01", "optimizer= and lr="),
    "adam's eps": ({"optimizer": lambda p: torch.optim.Adam(p, lr=1e-3, eps=1e-6), "lr": None},
                   "optimizer.groups[0].eps: saved 1e-08, this trainer 1e-06", "optimizer= and lr="),
    "loss": ({"loss_fn": other_loss}, "loss_fn: saved 'torch.nn.functional.cross_entropy', this trainer "
                                      "'test_checkpoints.other_loss'", "loss_fn="),
    "injected overflow": ({"inject_nonfinite": (4,)}, "inject_nonfinite: saved [1], this trainer [4]",
                          "inject_nonfinite="),
    "scheduler on skips": ({"step_scheduler_on_skip": True},
                           "step_scheduler_on_skip: saved False, this trainer True", "step_scheduler_on_skip="),
}


@pytest.mark.parametrize("case", list(DIFFERENT_RUNS))
def test_a_checkpoint_of_another_run_is_refused_naming_the_difference(saved, tmp_path, case):
    path, _ = saved
    kwargs, difference, argument = DIFFERENT_RUNS[case]
    target = trainer(model_seed=3, **{"inject_nonfinite": (1,), **kwargs})
    target.fit(1)
    before = full_state(target)
    with pytest.raises(CheckpointError) as err:
        target.load(path)
    message = str(err.value)
    assert "continues another run" in message and difference in message, message
    assert f"create the Trainer with the saved run's {argument}" in message and "Nothing was changed" in message
    assert full_state(target) == before


def test_settings_that_compare_equal_are_the_same_run():
    """gamma=1 and gamma=1.0 train the same steps: not a difference."""
    assert settings_differences({"gamma": 1, "lr": [0.5]}, {"gamma": 1.0, "lr": [0.5]}) == []
    assert settings_differences({"a": {"b": 1}}, {"a": {"b": 2}, "c": 3}) == [
        "a.b: saved 1, this trainer 2", "c: saved '(not set)', this trainer 3"]


def test_another_dataset_is_refused_by_its_digest(saved):
    path, _ = saved
    other = Dataset(DATA.x_train.flip(0), DATA.y_train.flip(0), DATA.x_test, DATA.y_test, name="digits")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        model = mlp(64, 32, 10, depth=2)
    target = Trainer(model, other, precision="fp16", device="cpu", optimizer="adam", lr=1e-3, batch_size=32,
                     init_scale=2.0**10, scheduler=step_lr, inject_nonfinite=(1,), progress=False)
    with pytest.raises(CheckpointError, match=r"data.digest: saved '[0-9a-f]{64}', this trainer '[0-9a-f]{64}'"):
        target.load(path)


def test_several_differences_are_all_named(saved):
    path, _ = saved
    target = trainer(model_seed=3, seed=7, batch_size=8, inject_nonfinite=(1,))
    with pytest.raises(CheckpointError) as err:
        target.load(path)
    assert "seed: saved 0, this trainer 7" in str(err.value) and "batch_size: saved 32, this trainer 8" in str(err.value)
    assert "the saved run's seed=, batch_size=" in str(err.value)


def test_another_model_is_refused(saved):
    path, _ = saved
    with pytest.raises(CheckpointError, match="holds another model: missing"):
        trainer(hidden=16, inject_nonfinite=(1,)).load(path)


# -- a restore that fails half-way is rolled back ------------------------------------------------


@pytest.mark.parametrize("failing", ["scaler", "scheduler", "rng"])
def test_a_restore_that_fails_half_way_is_rolled_back(saved, other, monkeypatch, failing):
    """The model and the optimizer are already loaded when the scaler, the scheduler or the
    RNG state fails: all of it is put back, and the message says nothing was changed."""
    path, expected = saved
    target, reset = other
    target.load(reset)
    before = full_state(target)
    calls = []

    def fail(*args, **kwargs):
        calls.append(failing)
        if len(calls) == 1:  # the restore fails; the rollback that follows succeeds
            raise RuntimeError("a late failure")
        return real(*args, **kwargs)

    if failing == "rng":
        import amp_lessons.checkpoints as checkpoints

        real = checkpoints.set_rng_state
        monkeypatch.setattr(checkpoints, "set_rng_state", fail)
    else:
        kind = type(getattr(target, failing))  # patched on the class: a scheduler's state_dict is its __dict__
        real = kind.load_state_dict
        monkeypatch.setattr(kind, "load_state_dict", fail)
    with pytest.raises(CheckpointError, match="could not be restored into this trainer .RuntimeError: a late failure") as err:
        target.load(path)
    assert "Nothing was changed" in str(err.value) and len(calls) == 2
    assert full_state(target) == before != expected


# -- save: refused paths leave nothing behind ----------------------------------------------------


def test_saving_onto_a_directory_says_so_and_leaves_no_tmp(tmp_path):
    """The issue's case: a bare IsADirectoryError, and DIR.tmp left behind."""
    t = trainer()
    t.fit(1)
    (tmp_path / "runs").mkdir()
    with pytest.raises(CheckpointError, match=re.escape(f"cannot save to {tmp_path / 'runs'}: it is a directory. "
                                                        "Nothing was written; pass a file path inside it")):
        t.save(tmp_path / "runs")
    with pytest.raises(CheckpointError, match="its folder .* does not exist. Nothing was written; create it first"):
        t.save(tmp_path / "nowhere" / "run.pt")
    with pytest.raises(TypeError, match="path must be a file path"):
        t.save(None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"] and not list((tmp_path / "runs").iterdir())


def test_a_failed_write_removes_its_temporary_file(tmp_path, monkeypatch):
    t = trainer()
    t.fit(1)

    def full_disk(obj, f, *args, **kwargs):
        with open(f, "wb") as out:
            out.write(b"PK\x03\x04half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(CheckpointError, match=r"cannot save to .*: writing run.pt.tmp failed \(No space left on device\). Nothing was written"):
        t.save(tmp_path / "run.pt")
    assert not list(tmp_path.iterdir())


def test_the_numpy_rng_is_saved_as_int64_and_restored_as_uint32(tmp_path):
    t = trainer(precision="bf16")
    t.fit(1)
    state = torch.load(t.save(tmp_path / "run.pt"), weights_only=True)
    assert state["rng"]["numpy"][1].dtype == torch.int64  # a dtype every torch release saves
    np.random.rand(5)
    expected = np.random.get_state()[1].copy()
    t.load(tmp_path / "run.pt")
    np.random.rand(5)
    assert np.random.get_state()[1].dtype == np.uint32
    assert np.array_equal(np.random.get_state()[1], expected)
