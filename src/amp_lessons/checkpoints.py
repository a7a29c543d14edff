"""Checkpoints of a :class:`~amp_lessons.training.Trainer`: a resume is exact, or refused.

A checkpoint holds the model, optimizer, GradScaler and lr scheduler states, the step count,
the RNG states and the history, and the settings that decide the run's next steps (seed,
data, batch size, accumulation, clipping, precision, scaler settings, optimizer and
scheduler). :func:`save` writes them with a SHA-256 digest of all of it. :func:`load`
reads a file only as tensors and plain values (``weights_only=True``: no code in a file
runs), recomputes the digest, compares the settings with the loading trainer's, checks
every value, and only then restores; a restore that fails half-way is rolled back. Every
refusal is one :class:`CheckpointError` that says what is wrong, that nothing was changed,
and what to do. Used in 03_grad_scaler (saving the scaler's state with the run).
"""

from __future__ import annotations

import copy
import hashlib
import math
import pickle
import random
import struct
import warnings
import zipfile

import numpy as np
import torch

from .arguments import check_factors, check_growth_interval, check_path, check_scale, is_number
from .history import COLUMNS, History
from .seeding import rng_state, set_rng_state

CHECKPOINT_FORMAT = "amp-lessons-checkpoint/3"  # /2: a digest of its contents; /3: the run's settings
_KEYS = ("precision", "settings", "signature", "step", "model", "optimizer", "scaler", "scheduler",
         "rng", "history", "digest")
_INTACT = "load an intact copy of the file, or train again and save"


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded into this trainer (corrupt, or from another run)."""


def _refuse(path, problem: str, todo: str) -> CheckpointError:
    return CheckpointError(f"{path} {problem}. Nothing was changed; {todo}.")


# -- the digest ------------------------------------------------------------------------------


def checkpoint_digest(state: dict) -> str:
    """The SHA-256 of everything in ``state`` but its ``"digest"`` entry: every tensor's dtype,
    shape and bytes, every number, string and container, in order. :func:`save` stores it;
    :func:`load` recomputes it from what ``torch.load`` returned, which reads tensor bytes
    without a checksum of its own."""
    h = hashlib.sha256()
    _feed(h, {k: v for k, v in state.items() if k != "digest"})
    return h.hexdigest()


def _feed(h, obj) -> None:
    """Add ``obj`` to the hash ``h``, each value tagged with its type (1, 1.0 and True differ)."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach().to("cpu").contiguous().reshape(-1)
        h.update(f"T{t.dtype}{tuple(obj.shape)}:".encode())
        h.update(t.view(torch.uint8).numpy().tobytes())
    elif isinstance(obj, dict):
        h.update(f"D{len(obj)}:".encode())
        for key, value in obj.items():
            _feed(h, key)
            _feed(h, value)
    elif isinstance(obj, (list, tuple)):
        h.update(f"{'L' if isinstance(obj, list) else 'U'}{len(obj)}:".encode())
        for value in obj:
            _feed(h, value)
    elif obj is None or isinstance(obj, bool):
        h.update(f"B{obj}:".encode())
    elif isinstance(obj, int):
        h.update(f"I{obj}:".encode())
    elif isinstance(obj, float):
        h.update(b"F" + struct.pack("<d", obj))
    elif isinstance(obj, str):
        h.update(f"S{len(obj)}:{obj}".encode())
    else:
        raise TypeError(f"a checkpoint holds only tensors, numbers, strings and containers; got {type(obj).__name__}")


def tensor_digest(*tensors) -> str:
    """The SHA-256 of tensors' dtypes, shapes and bytes (a run's training data, in its settings)."""
    h = hashlib.sha256()
    for t in tensors:
        _feed(h, t)
    return h.hexdigest()


# -- RNG states as a checkpoint holds them ---------------------------------------------------


def rng_for_checkpoint() -> dict:
    """:func:`~amp_lessons.seeding.rng_state` with NumPy's key array as an int64 tensor:
    ``torch.load(weights_only=True)`` reads it, and no torch release has to know the uint32
    dtype NumPy keeps it in."""
    rng = rng_state()
    np_state = rng["numpy"]
    rng["numpy"] = (np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:])
    return rng


def rng_from_checkpoint(rng) -> dict:
    """The inverse of :func:`rng_for_checkpoint`: NumPy's key array back as uint32."""
    rng = dict(rng)
    np_state = rng["numpy"]
    rng["numpy"] = (np_state[0], np_state[1].cpu().numpy().astype(np.uint32), *np_state[2:])
    return rng


# -- save ------------------------------------------------------------------------------------


def _state(trainer) -> dict:
    """What :func:`save` writes, but the digest (references to the live tensors, not copies)."""
    return {
        "format": CHECKPOINT_FORMAT,
        "precision": trainer.precision,
        "settings": trainer.run_settings(),
        "signature": _signature(trainer.model),
        "step": trainer.step_count,
        "model": trainer.model.state_dict(),
        "optimizer": trainer.optimizer.state_dict(),
        "scaler": trainer.scaler.state_dict(),
        "scheduler": trainer.scheduler.state_dict() if trainer.scheduler is not None else None,
        "rng": rng_for_checkpoint(),
        "history": trainer.history.as_dicts(),
    }


def _signature(model) -> dict:
    return {k: list(v.shape) for k, v in model.state_dict().items()}


def _writable(path):
    """``path`` as a Path where a checkpoint file can be written, or a clear CheckpointError."""
    path = check_path("path", path)
    if path.is_dir():
        raise CheckpointError(f"cannot save to {path}: it is a directory. Nothing was written; pass a "
                              f"file path inside it, e.g. {path / 'run.pt'}")
    if not path.parent.is_dir():
        raise CheckpointError(f"cannot save to {path}: its folder {path.parent} does not exist. Nothing was "
                              f"written; create it first, e.g. Path({str(path.parent)!r}).mkdir(parents=True)")
    return path


def save(trainer, path):
    """Write ``trainer``'s checkpoint to ``path`` (via ``path.tmp``, renamed when complete).

    A state that could not be resumed (inf/NaN weights or optimizer state: a run that
    diverged) raises :class:`CheckpointError` and writes nothing; so does a path that is a
    directory or lies in a folder that does not exist. Used by ``Trainer.save`` (03).
    """
    path = _writable(path)
    state = _state(trainer)
    try:
        _check_values(trainer, state)
    except CheckpointError as err:
        raise CheckpointError(f"refusing to save: {err}. Nothing was written.") from None
    state["digest"] = checkpoint_digest(state)
    tmp = path.with_name(path.name + ".tmp")
    try:
        torch.save(state, tmp)
        tmp.replace(path)  # never leave a half-written checkpoint under the real name
    except OSError as err:
        if tmp.is_file():
            tmp.unlink()
        raise CheckpointError(f"cannot save to {path}: writing {tmp.name} failed ({err.strerror or err}). "
                              "Nothing was written; choose a path you can write to, with room for the file") from None
    return path


# -- read: what is wrong with a file, said once ---------------------------------------------


def _read(path) -> dict:
    """``torch.load(path, weights_only=True)``, or one CheckpointError naming what is wrong."""
    path = check_path("path", path)
    if not path.exists():
        raise _refuse(path, "does not exist", "check the path (save() writes the file you give it)")
    if path.is_dir():
        raise _refuse(path, "is a directory, not a checkpoint file", f"pass the file save() wrote, e.g. {path / 'run.pt'}")
    _check_archive(path)
    try:
        with warnings.catch_warnings():
            # A damaged file can make torch warn (about a pickle protocol, say) and still
            # load: the digest and the checks below decide whether it is used, not a warning.
            warnings.simplefilter("ignore")
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        if "weights only" in str(err).lower():
            raise _refuse(path, "is not a checkpoint of this course, or is damaged: it holds Python objects "
                          "that no checkpoint holds (they were not loaded, so no code in the file ran)",
                          "pass a file that Trainer.save wrote") from None
        raise _refuse(path, "is damaged: its contents cannot be read back", _INTACT) from None
    except Exception:  # torch's archive reader: a record that is cut or changed
        raise _refuse(path, "is damaged: the archive torch.save wrote cannot be read back", _INTACT) from None


def _check_archive(path) -> None:
    """torch.save writes a zip archive whose table of contents comes last: an empty file, a
    file of another kind, and a file cut short are told apart before torch reads it."""
    size = path.stat().st_size
    if size == 0:
        raise _refuse(path, "is empty (0 bytes): the save was interrupted or the file was emptied", _INTACT)
    with open(path, "rb") as f:
        head = f.read(4)
        f.seek(max(0, size - 65_557))  # the end record sits in the last 22 bytes + a comment
        tail = f.read()
    if len(head) < 4 and b"PK\x03\x04".startswith(head):
        raise _refuse(path, f"is truncated: it ends after {size:,} bytes, before the table of contents "
                      "that torch.save writes last", _INTACT)
    if head != b"PK\x03\x04":
        raise _refuse(path, "is not a checkpoint of this course: it is not a file that torch.save writes",
                      "pass a file that Trainer.save wrote")
    if b"PK\x05\x06" not in tail:
        raise _refuse(path, f"is truncated: it ends after {size:,} bytes, before the table of contents "
                      "that torch.save writes last", _INTACT)
    try:
        with zipfile.ZipFile(path) as z:
            names = z.namelist()
    except (zipfile.BadZipFile, OSError, ValueError, EOFError):
        raise _refuse(path, "is damaged: its table of contents cannot be read", _INTACT) from None
    if not any(n.endswith("data.pkl") for n in names):
        raise _refuse(path, "is not a checkpoint of this course: a zip archive, but not one torch.save wrote",
                      "pass a file that Trainer.save wrote")


# -- load ------------------------------------------------------------------------------------


def load(trainer, path):
    """Restore into ``trainer`` a checkpoint that :func:`save` wrote from the same run.

    Everything is checked before anything is changed: the file (truncated, damaged, not a
    checkpoint), the digest, the model, the run's settings and every value. Any failure
    raises :class:`CheckpointError` and leaves ``trainer`` exactly as it was, also when a
    restore fails half-way (it is rolled back). Used by ``Trainer.load`` (03).
    """
    state = _read(path)
    _validate(trainer, state, path)
    before = snapshot(trainer)
    try:
        restore(trainer, state)
    except Exception as err:  # e.g. a state torch refuses late: put everything back
        restore(trainer, before)
        raise _refuse(path, f"could not be restored into this trainer ({type(err).__name__}: "
                      f"{_first_line(err)})", "load it into a Trainer built as the saved run was") from None
    return trainer


def snapshot(trainer) -> dict:
    """``trainer``'s state as :func:`restore` takes it (copies, not references)."""
    return copy.deepcopy({
        "model": trainer.model.state_dict(), "optimizer": trainer.optimizer.state_dict(),
        "scaler": trainer.scaler.state_dict(),
        "scheduler": trainer.scheduler.state_dict() if trainer.scheduler is not None else None,
        "rng": rng_for_checkpoint(), "step": trainer.step_count, "history": trainer.history.as_dicts(),
    })


def restore(trainer, state) -> None:
    """Put ``state`` (a checked checkpoint, or a :func:`snapshot`) into ``trainer``."""
    history = History.from_dicts(state["history"])
    step = int(state["step"])
    trainer.model.load_state_dict(state["model"])
    trainer.optimizer.load_state_dict(state["optimizer"])
    if trainer.scaler.is_enabled():
        trainer.scaler.load_state_dict(state["scaler"])
    if trainer.scheduler is not None:
        trainer.scheduler.load_state_dict(state["scheduler"])
    set_rng_state(rng_from_checkpoint(state["rng"]))
    trainer.step_count, trainer.history = step, history


def _first_line(err) -> str:
    return str(err).splitlines()[0] if str(err) else ""


def _validate(trainer, state, path) -> None:
    """Raise :class:`CheckpointError` unless ``state`` is an intact checkpoint of this run."""
    _check_marker(state, path)
    try:
        intact = state["digest"] == checkpoint_digest(state)
    except TypeError:  # a value of a type save() never writes
        intact = False
    if not intact:
        raise _refuse(path, "is corrupt: its digest does not match its contents (the file was changed or "
                      "damaged after it was written)", _INTACT)
    try:
        _check_same_model(trainer, state, path)
        _check_same_run(trainer, state, path)
        _check_values(trainer, state)
    except CheckpointError as err:
        if str(err).startswith(str(path)):  # already says what to do
            raise
        raise _refuse(path, f"cannot be resumed: {err}", "load another checkpoint of the run") from None
    except (KeyError, TypeError, AttributeError, ValueError, IndexError) as err:
        raise _refuse(path, f"is malformed ({type(err).__name__}: {_first_line(err)})",
                      "pass a file that Trainer.save wrote") from None


def _check_marker(state, path) -> None:
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
        found = state.get("format") if isinstance(state, dict) else None
        if isinstance(found, str) and found.startswith("amp-lessons-checkpoint/"):
            raise _refuse(path, f"is a checkpoint of another format ({found!r}; this version reads "
                          f"{CHECKPOINT_FORMAT!r}, which records the run's settings and a digest)",
                          "train again and save it with this version")
        raise _refuse(path, f"is not a checkpoint of this course: torch.save wrote it, but without the "
                      f"{CHECKPOINT_FORMAT!r} marker", "pass a file that Trainer.save wrote")
    missing = [k for k in _KEYS if k not in state]
    if missing:
        raise _refuse(path, f"is an incomplete checkpoint: it has no {', '.join(missing)}",
                      "pass a file that Trainer.save wrote")


def _check_same_model(trainer, state, path) -> None:
    mine, theirs = _signature(trainer.model), state["signature"]
    if mine != theirs:
        missing = sorted(set(mine) - set(theirs))[:3]
        extra = sorted(set(theirs) - set(mine))[:3]
        shapes = [k for k in set(mine) & set(theirs) if mine[k] != theirs[k]][:3]
        raise _refuse(path, f"holds another model: missing {missing}, unexpected {extra}, different "
                      f"shapes {shapes}", "load it into a Trainer of the model it was saved from")


# -- the run's settings: everything that decides the next steps -------------------------------


def _flat(prefix, value):
    """(dotted name, value) pairs of nested settings: ``optimizer.groups[0].lr``."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _flat(f"{prefix}.{k}" if prefix else str(k), v)
    elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        for i, v in enumerate(value):
            yield from _flat(f"{prefix}[{i}]", v)
    else:
        yield prefix, value


_ABSENT = "(not set)"


def settings_differences(saved: dict, mine: dict) -> list[str]:
    """Each setting that differs, as ``"seed: saved 0, this trainer 1"``. Used by :func:`load`."""
    a, b = dict(_flat("", saved)), dict(_flat("", mine))
    out = []
    for key in list(dict.fromkeys([*a, *b])):
        x, y = a.get(key, _ABSENT), b.get(key, _ABSENT)
        if x != y:  # 1 and 1.0 are the same setting
            out.append(f"{key}: saved {x!r}, this trainer {y!r}")
    return out


_ARGUMENTS = {"scaler": "scaler=, init_scale=, growth_interval=, growth_factor=, backoff_factor=",
              "optimizer": "optimizer= and lr=", "scheduler": "scheduler=", "data": "data="}


def _check_same_run(trainer, state, path) -> None:
    diffs = settings_differences(state["settings"], trainer.run_settings())
    if diffs:
        names = dict.fromkeys(_ARGUMENTS.get(d.split(":")[0].split(".")[0].split("[")[0],
                                             d.split(":")[0].split(".")[0] + "=") for d in diffs)
        raise _refuse(path, "continues another run; it differs from this trainer in " + "; ".join(diffs),
                      f"create the Trainer with the saved run's {', '.join(names)} to resume it exactly")


# -- the values a run can hold ---------------------------------------------------------------


def _check_values(trainer, state) -> None:
    """Raise :class:`CheckpointError` naming the first value a run could not hold."""
    step = state["step"]
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise CheckpointError(f"its step count is {step!r}; it must be an integer >= 0")
    _check_history(state["history"], step)
    _check_model(state["model"], trainer.model.state_dict())
    params = [p for g in trainer.optimizer.param_groups for p in g["params"]]
    _check_optimizer(state["optimizer"], params, with_scheduler=trainer.scheduler is not None)
    if trainer.scaler.is_enabled():
        _check_scaler_state(state["scaler"], trainer.min_scale)
    if trainer.scheduler is not None:
        _check_scheduler_state(state["scheduler"])
    _check_rng(state["rng"])


def _check_finite(what, value) -> None:
    if isinstance(value, torch.Tensor):
        if value.is_floating_point() or value.is_complex():
            bad = int((~torch.isfinite(value)).sum())
            if bad:
                raise CheckpointError(f"{what} holds {bad} inf/NaN value{'s' if bad > 1 else ''}")
    elif not is_number(value) or not math.isfinite(value):
        raise CheckpointError(f"{what} is {value!r}; it must be a finite number")


def _number(value):
    """A one-element tensor as a Python number (an optimizer may keep its lr as a tensor)."""
    return value.item() if isinstance(value, torch.Tensor) and value.numel() == 1 else value


def _check_history(history, step) -> None:
    names = list(COLUMNS)
    if not isinstance(history, list) or len(history) != step:
        got = len(history) if isinstance(history, list) else type(history).__name__
        raise CheckpointError(f"its history holds {got} records for {step} steps; a run records one per step")
    for i, record in enumerate(history):
        if not isinstance(record, dict) or list(record) != names:
            raise CheckpointError(f"history record {i} does not have the columns {', '.join(names)}")
        if type(record["step"]) is not int or record["step"] != i or not isinstance(record["skipped"], bool) \
                or not all(is_number(record[n]) for n in names if n != "skipped"):
            raise CheckpointError(f"history record {i} is malformed: {record}")
        if not (math.isfinite(record["scale"]) and record["scale"] > 0):
            raise CheckpointError(f"history record {i} has a loss scale of {record['scale']!r}; a scale is > 0")


def _check_model(saved, mine) -> None:
    if not isinstance(saved, dict) or list(saved) != list(mine):
        raise CheckpointError("its model weights do not name this model's tensors")
    for name, ref in mine.items():
        t = saved[name]
        if not isinstance(t, torch.Tensor) or t.shape != ref.shape or t.dtype != ref.dtype:
            got = f"{t.dtype} of shape {list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise CheckpointError(f"model tensor {name!r} is {got}; the model's is {ref.dtype} of shape "
                                  f"{list(ref.shape)}")
        _check_finite(f"model tensor {name!r}", t)


_NONNEGATIVE = ("eps", "weight_decay", "momentum", "dampening")


def _check_hyperparameter(what, key, value, with_scheduler) -> None:
    value = _number(value)
    if value is None or isinstance(value, (bool, str)):
        return
    if key == "betas":
        if not isinstance(value, (tuple, list)) or not all(is_number(_number(b)) and 0 <= _number(b) < 1
                                                         for b in value):
            raise CheckpointError(f"{what} is {value!r}; each beta must lie in [0, 1)")
        return
    if isinstance(value, (tuple, list)):
        for v in value:
            _check_finite(what, _number(v))
        return
    _check_finite(what, value)
    if key in ("lr", "initial_lr"):
        # A schedule may end at lr 0 (CosineAnnealingLR with eta_min=0); without one, lr > 0.
        if value < 0 or (value == 0 and (key == "initial_lr" or not with_scheduler)):
            raise CheckpointError(f"{what} is {value!r}; a learning rate must be > 0")
    elif key in _NONNEGATIVE and value < 0:
        raise CheckpointError(f"{what} is {value!r}; it must be >= 0")


def _check_optimizer(saved, params, with_scheduler) -> None:
    groups, state = saved["param_groups"], saved["state"]
    ids = [i for g in groups for i in g["params"]]
    if len(ids) != len(params) or len(set(ids)) != len(ids):
        raise CheckpointError("its optimizer state holds another set of parameters")
    shapes = {i: p.shape for i, p in zip(ids, params)}
    for k, group in enumerate(groups):
        for key, value in group.items():
            if key != "params":
                _check_hyperparameter(f"the optimizer's {key} (param group {k})", key, value, with_scheduler)
    for pid, entry in state.items():
        if pid not in shapes:
            raise CheckpointError(f"its optimizer state names parameter {pid!r}, which no param group holds")
        for key, value in entry.items():
            _check_optimizer_value(f"the optimizer's {key!r} of parameter {pid}", key, value, shapes[pid])


def _check_optimizer_value(what, key, value, shape) -> None:
    value = _number(value) if key == "step" else value
    if value is None or isinstance(value, bool):
        return
    _check_finite(what, value)
    if key == "step" and (value < 0 or value != int(value)):
        raise CheckpointError(f"{what} is {value!r}; a step count is an integer >= 0")
    if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape != shape:
        raise CheckpointError(f"{what} has shape {list(value.shape)}; its parameter has {list(shape)}")
    if key in ("exp_avg_sq", "max_exp_avg_sq") and bool((value < 0).any()):
        raise CheckpointError(f"{what} holds negative values; a mean of squares is >= 0")


def _check_scaler_state(saved, min_scale) -> None:
    try:
        check_scale("the loss scale", saved["scale"])
        check_factors(saved["growth_factor"], saved["backoff_factor"])
        check_growth_interval(saved["growth_interval"])
        tracker = saved["_growth_tracker"]
        if not isinstance(tracker, int) or not 0 <= tracker < saved["growth_interval"]:
            raise ValueError(f"its count of clean steps is {tracker!r}; it must be an integer from 0 "
                             f"to growth_interval - 1 ({saved['growth_interval'] - 1})")
    except ValueError as err:
        raise CheckpointError(f"its GradScaler state is invalid: {err}") from None
    if saved["scale"] < min_scale:
        raise CheckpointError(f"it holds a loss scale of {saved['scale']:.3g}, below this trainer's floor "
                              f"min_scale={min_scale:.3g}: its run had collapsed, and resuming it would stop "
                              "at the first step")


def _check_scheduler_state(saved) -> None:
    if not isinstance(saved, dict):
        raise CheckpointError("its lr scheduler state is not a dict")
    _check_all_finite("its lr scheduler state", saved)
    if "last_epoch" in saved and (not isinstance(saved["last_epoch"], int) or saved["last_epoch"] < 0):
        raise CheckpointError(f"its lr scheduler's last_epoch is {saved['last_epoch']!r}; it must be >= 0")
    for key in ("base_lrs", "_last_lr"):
        for lr in saved.get(key) or ():
            if not is_number(_number(lr)) or _number(lr) < 0 or (key == "base_lrs" and _number(lr) == 0):
                raise CheckpointError(f"its lr scheduler's {key} holds {lr!r}; a learning rate must be > 0")


def _check_all_finite(what, value) -> None:
    """Every float and tensor inside nested dicts and lists is finite."""
    if isinstance(value, dict):
        for k, v in value.items():
            _check_all_finite(f"{what}[{k!r}]", v)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _check_all_finite(f"{what}[{i}]", v)
    elif isinstance(value, (float, torch.Tensor)):
        _check_finite(what, value)


def _check_rng(rng) -> None:
    """Try each saved state on a scratch generator: the global ones stay untouched."""
    try:
        random.Random().setstate(rng["python"])
        key = rng["numpy"][1]
        if not isinstance(key, torch.Tensor) or key.dim() != 1 or not bool(((key >= 0) & (key < 2**32)).all()):
            raise ValueError("NumPy's key is not 32-bit words")
        np.random.RandomState().set_state(rng_from_checkpoint(rng)["numpy"])
        torch.Generator().set_state(rng["torch"])
        for state in rng.get("cuda", ()):
            if not isinstance(state, torch.Tensor) or state.dtype != torch.uint8:
                raise ValueError("a CUDA generator state is not a byte tensor")
    except (KeyError, TypeError, ValueError, RuntimeError, IndexError) as err:
        raise CheckpointError(f"its random number generator states are invalid ({_first_line(err)})") from None
