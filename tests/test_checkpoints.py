"""Checkpoints that never load silently wrong: a digest of the contents, and every value checked.

References: the state of the trainer that saved the file, and the state of the trainer that
loads it, compared value by value and bit by bit (floats by repr, tensors by their bytes).
"""

import collections
import math
import random
import zipfile

import numpy as np
import pytest
import torch

from amp_lessons.data import digits
from amp_lessons.models import mlp
from amp_lessons.seeding import rng_state
from amp_lessons.training import CheckpointError, ScaleCollapseError, Trainer, checkpoint_digest

DATA = digits()


def step_lr(opt):
    return torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)


def trainer(seed=0, **kwargs):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = mlp(64, 32, 10, depth=2)
    kwargs = {"precision": "fp16", "optimizer": "adam", "lr": 1e-3, "batch_size": 32,
              "init_scale": 2.0**10, "scheduler": step_lr, "progress": False, **kwargs}
    return Trainer(model, DATA, device="cpu", seed=seed, **kwargs)


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
    target = trainer(seed=3)
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
        assert outcome == "refused" and "do not match the SHA-256 digest" in message, name


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
    t = trainer(seed=3)
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
    other = trainer(seed=3, scheduler=cosine)
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
