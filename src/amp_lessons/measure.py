"""Activation memory and step timing, measured the same way on every device.

- :class:`SavedTensorsMeter` counts the bytes autograd keeps for backward (the "activation
  memory" of the card's claim C2), deduplicated by storage, on any device. Under autocast
  the 16-bit copies of the weights are saved too: they are counted apart, as
  ``weight_copy_bytes``, so the activation figure compares like with like.
- :func:`saved_memory` runs one forward pass + loss under a precision and meters it;
  :func:`saved_by_layer` splits its activation bytes by the layer that saved them.
- :func:`cuda_peak_memory` is the CUDA allocator's peak for one call (``None`` elsewhere).
- :func:`step_flops` counts the matmul work of one training step, for achieved FLOP/s.
- :func:`time_step` times a step right: warm-up calls, ``torch.cuda.synchronize()`` on
  CUDA, the median of several runs; :func:`time_interleaved` times several side by side.
- :func:`matmul_gflops`: the achieved GFLOP/s of an n x n matmul in one precision (the
  best of its repeats), the figure that decides whether 16-bit is faster on a device.
- :func:`training_memory` and :func:`doubled_batch`: everything a training step holds
  (weights, gradients, optimizer state, 16-bit weight copies, activations), and what a
  batch twice as large costs in each precision.

Used in 05_putting_it_together and by ``python -m amp_lessons bench``.
"""

from __future__ import annotations

import copy
import os
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from .precision import dtype_of, float32_matmul_precision, parse_precision, uses_autocast

MiB = 2**20  # the tables and figures say MiB: 2**20 bytes, not 10**6

# Autograd nodes that only view or re-lay-out their single input: a saved tensor reached
# from a parameter through these alone holds the parameter's values, not an activation.
_VIEW_NODES = frozenset({
    "TBackward0", "TransposeBackward0", "PermuteBackward0", "ViewBackward0",
    "UnsafeViewBackward0", "ReshapeAliasBackward0", "ExpandBackward0", "AliasBackward0",
    "UnsqueezeBackward0", "SqueezeBackward0", "SqueezeBackward1", "UnsqueezeBackward1",
    "SliceBackward0", "SelectBackward0", "AsStridedBackward0", "ViewAsRealBackward0",
})
_CAST_NODE = "ToCopyBackward0"


@dataclass
class SavedMemory:
    """What autograd saved for backward, in bytes, split three ways.

    - ``activation_bytes``: tensors computed from the input (the memory mixed precision halves);
    - ``weight_copy_bytes``: casts of parameters (autocast's 16-bit weight copies);
    - ``parameter_bytes``: the parameters themselves, saved by reference (no extra memory).

    ``by_dtype`` splits ``activation_bytes`` by dtype name; ``by_layer`` by (layer, dtype
    name), where the meter was told which layer runs (:func:`saved_by_layer`).
    ``input_bytes`` is the part of ``activation_bytes`` that is the caller's own input
    tensors, saved by reference (fp32's first matmul saves ``x`` itself; under autocast it
    saves a 16-bit copy, which is not counted here): the step holds those anyway.
    """

    activation_bytes: int = 0
    weight_copy_bytes: int = 0
    parameter_bytes: int = 0
    n_saved: int = 0
    input_bytes: int = 0
    by_dtype: dict[str, int] = field(default_factory=dict)
    by_layer: dict[tuple[str, str], int] = field(default_factory=dict)

    @property
    def activation_mb(self) -> float:
        return self.activation_bytes / MiB

    @property
    def weight_copy_mb(self) -> float:
        return self.weight_copy_bytes / MiB

    def table(self) -> str:
        """A short text summary, one line per kind."""
        dtypes = ", ".join(f"{k} {v / MiB:.3f}" for k, v in sorted(self.by_dtype.items()))
        return "\n".join([
            f"activations        {self.activation_mb:9.3f} MiB  ({dtypes})",
            f"16-bit weight copies {self.weight_copy_mb:7.3f} MiB",
            f"parameters (shared)  {self.parameter_bytes / MiB:7.3f} MiB  (no extra memory)",
        ])


def _storage_key(t: torch.Tensor):
    ptr = t.untyped_storage().data_ptr()
    if ptr:
        return (t.device.type, ptr)
    # meta tensors (size estimates) have no data: a view is keyed by the tensor it views
    # (the meter keeps every saved tensor alive, so ids are not reused meanwhile)
    base = t._base if t._base is not None else t
    return ("id", id(base))


def _is_cast_of_parameter(t: torch.Tensor, params: set[int]) -> bool:
    """True when ``t`` was made from a parameter by casts and views only, with one cast.

    Follows the autograd graph (``ToCopyBackward0`` → ``AccumulateGrad`` of a parameter),
    so it is exact for parameters that require grad, as autocast's weight cache does.
    """
    node = t.grad_fn
    cast = False
    while node is not None:
        name = type(node).__name__
        if name == "AccumulateGrad":
            return cast and id(node.variable) in params
        if name == _CAST_NODE:
            cast = True
        elif name not in _VIEW_NODES:
            return False
        nxt = [n for n, _ in node.next_functions if n is not None]
        if len(nxt) != 1:
            return False
        node = nxt[0]
    return False


def _equals_cast_of(t: torch.Tensor, params: Iterable[torch.Tensor]) -> bool:
    """Fallback for frozen parameters (no autograd history): same values as a cast of one."""
    for p in params:
        if p.dtype == t.dtype or p.device != t.device or p.numel() != t.numel():
            continue
        candidates = [p] + ([p.mT] if p.dim() == 2 else [])
        for c in candidates:
            if c.shape == t.shape and torch.equal(c.detach().to(t.dtype), t.detach()):
                return True
    return False


class SavedTensorsMeter:
    """Context manager: meter every tensor saved for backward inside it.

    ``parameters`` (a module or an iterable of tensors) tells which saved tensors are
    weights rather than activations; ``inputs``, which of the activations are the
    caller's own input tensors (``result.input_bytes``). Each storage is counted once, so views of one
    tensor and a weight copy reused by several ops are not double counted.

        with SavedTensorsMeter(model) as meter:
            loss = loss_fn(model(x), y)
        meter.result.activation_bytes
    """

    def __init__(self, parameters=(), where: Callable[[], str] | None = None,
                 inputs: Iterable[torch.Tensor] = ()):
        self._where = where  # the layer running now, for ``result.by_layer``
        self._input_storages = {_storage_key(t) for t in inputs}  # for ``result.input_bytes``
        if isinstance(parameters, nn.Module):
            parameters = parameters.parameters()
        self._params = [p for p in parameters]
        self._param_ids = {id(p) for p in self._params}
        self._param_storages = {_storage_key(p) for p in self._params}
        self._seen: set = set()
        self.result = SavedMemory()
        self._hooks = None

    def _pack(self, t: torch.Tensor):
        self.result.n_saved += 1
        key = _storage_key(t)
        if key in self._seen:
            return t
        self._seen.add(key)
        nbytes = t.untyped_storage().nbytes() or t.numel() * t.element_size()
        if key in self._param_storages:
            self.result.parameter_bytes += nbytes
        elif _is_cast_of_parameter(t, self._param_ids) or (
            t.grad_fn is None and t.is_floating_point() and _equals_cast_of(t, self._params)
        ):
            self.result.weight_copy_bytes += nbytes
        else:
            self.result.activation_bytes += nbytes
            if key in self._input_storages:
                self.result.input_bytes += nbytes
            name = str(t.dtype).removeprefix("torch.")
            self.result.by_dtype[name] = self.result.by_dtype.get(name, 0) + nbytes
            if self._where is not None:
                at = (self._where(), name)
                self.result.by_layer[at] = self.result.by_layer.get(at, 0) + nbytes
        return t

    def __enter__(self) -> SavedTensorsMeter:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
        self._hooks = None


def saved_memory(model: nn.Module, x: torch.Tensor, y: torch.Tensor | None = None,
                 precision="fp32", loss_fn=nn.functional.cross_entropy) -> SavedMemory:
    """Bytes saved for backward by one forward pass (+ loss when ``y`` is given) in ``precision``.

    The pass runs as the training step does: under ``torch.autocast`` for bf16/fp16, in
    float32 otherwise (tf32 changes matmul arithmetic, not what is saved). The graph is
    dropped afterwards; no backward runs.
    """
    name = parse_precision(precision)
    device_type = x.device.type
    inputs = (x,) if y is None else (x, y)
    with SavedTensorsMeter(model, inputs=inputs) as meter, float32_matmul_precision(name):
        with torch.autocast(device_type, dtype=dtype_of(name), enabled=uses_autocast(name)):
            out = model(x)
            if y is not None:
                out = loss_fn(out, y)
    del out
    return meter.result


def saved_by_layer(model: nn.Module, x: torch.Tensor, precision="fp32") -> dict[tuple[str, str], int]:
    """Activation bytes one forward pass of ``model`` saves in ``precision``, by (child
    layer, dtype name): forward hooks on ``model``'s direct children say which one is
    running when autograd saves a tensor (``"<model>"`` between them). Weight copies and
    parameters are left out, as in :func:`saved_memory`. Used in 05_putting_it_together.
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module; got {type(model).__name__}")
    name = parse_precision(precision)
    running = ["<model>"]

    def enter(module, args, layer):
        running.append(layer)

    def leave(module, args, output):
        running.pop()  # returns None: the layer's output stays as it is

    hooks = [h for layer, child in model.named_children()
             for h in (child.register_forward_pre_hook(lambda m, a, layer=layer: enter(m, a, layer)),
                       child.register_forward_hook(leave))]
    try:
        with SavedTensorsMeter(model, where=lambda: running[-1]) as meter, float32_matmul_precision(name):
            with torch.autocast(x.device.type, dtype=dtype_of(name), enabled=uses_autocast(name)):
                out = model(x)
        del out
    finally:
        for h in hooks:
            h.remove()
    return dict(sorted(meter.result.by_layer.items()))


def step_flops(model: nn.Module, x: torch.Tensor, y: torch.Tensor | None = None,
               loss_fn=nn.functional.cross_entropy) -> int:
    """Floating-point operations of one forward + loss + backward pass (matmuls, attention).

    Counted by ``torch.utils.flop_counter.FlopCounterMode`` on a copy of the model on the
    meta device: nothing is computed and the model is not touched. Elementwise ops are
    not counted: the figure is the work tensor cores or AMX could speed up.
    """
    # a meta copy without copying the data: each parameter and buffer maps to an empty twin
    memo = {id(t): (nn.Parameter(torch.empty_like(t, device="meta"), t.requires_grad)
                    if isinstance(t, nn.Parameter) else torch.empty_like(t, device="meta"))
            for t in [*model.parameters(), *model.buffers()]}
    meta = copy.deepcopy(model, memo)
    x = torch.empty_like(x, device="meta").requires_grad_(x.requires_grad)
    counter = FlopCounterMode(display=False)
    with counter:
        out = meta(x)
        if y is not None:
            out = loss_fn(out, torch.empty_like(y, device="meta"))
        out.sum().backward()
    return int(counter.get_total_flops())


@dataclass(frozen=True)
class PeakMemory:
    """CUDA allocator figures for one call: the peak, and what was allocated before it."""

    peak_bytes: int
    before_bytes: int

    @property
    def peak_mb(self) -> float:
        return self.peak_bytes / MiB

    @property
    def added_mb(self) -> float:
        """The peak above what was already allocated: what the call itself needed."""
        return (self.peak_bytes - self.before_bytes) / MiB


def cuda_peak_memory(fn: Callable[[], object], device) -> PeakMemory | None:
    """Run ``fn()`` once and return the allocator's peak on a CUDA ``device``; ``None`` elsewhere.

    CPU memory has no per-call peak counter that torch exposes, so on CPU the lessons use
    the saved-tensor bytes of :func:`saved_memory` (which are exact on every device).
    """
    device = torch.device(device)
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    fn()
    torch.cuda.synchronize(device)
    return PeakMemory(torch.cuda.max_memory_allocated(device), before)


@dataclass(frozen=True)
class Timing:
    """Wall-clock times of repeated calls, in milliseconds; read the median."""

    times_ms: tuple[float, ...]

    @property
    def median_ms(self) -> float:
        return statistics.median(self.times_ms)

    @property
    def min_ms(self) -> float:
        return min(self.times_ms)

    @property
    def spread(self) -> float:
        """Interquartile range / median: how noisy the runs were (0.1 = 10%).

        Quartiles, not min and max, so one interrupted run does not count as noise: the
        median it is read against ignores that run too.
        """
        if len(self.times_ms) < 2 or not self.median_ms:
            return 0.0
        low, _, high = statistics.quantiles(self.times_ms, n=4, method="inclusive")
        return (high - low) / self.median_ms


def synchronize(device) -> None:
    """Wait for queued GPU work (CUDA, MPS); a no-op on CPU, where calls are synchronous."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def time_step(step: Callable[[], object], device="cpu", warmup: int = 3, repeats: int = 10) -> Timing:
    """Time ``step()``: ``warmup`` untimed calls, then ``repeats`` timed ones.

    GPU work is asynchronous: without a synchronize the clock would stop when the kernels
    are queued, not when they finish. Warm-up absorbs one-off costs (allocator growth,
    kernel selection, autocast's first casts). Report the median, not the mean: one
    interruption by another process should not move the figure.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1; got {repeats}")
    for _ in range(warmup):
        step()
    synchronize(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
    return Timing(tuple(times))


def time_interleaved(steps: dict[str, Callable[[], object]], device="cpu", warmup: int = 2,
                     repeats: int = 7, on_round: Callable[[], object] | None = None) -> dict[str, Timing]:
    """Time several steps side by side: after warm-up, each round times one call of each.

    On a shared or thermally throttled machine the speed drifts over seconds; interleaving
    puts every step under the same drift, so their ratios stay fair. ``on_round`` is called
    after each round (a progress bar). Returns one :class:`Timing` per name.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1; got {repeats}")
    for step in steps.values():
        for _ in range(warmup):
            step()
    synchronize(device)
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            synchronize(device)
            times[name].append((time.perf_counter() - start) * 1e3)
        if on_round is not None:
            on_round()
    return {name: Timing(tuple(t)) for name, t in times.items()}


# -- matmul throughput ----------------------------------------------------------------------


def matmul_flops(n: int, m: int | None = None, k: int | None = None) -> int:
    """Floating-point operations of an (n x k) @ (k x m) matmul: one multiply + one add each."""
    m = n if m is None else m
    k = n if k is None else k
    return 2 * n * m * k


def matmul_gflops(n: int, precision="fp32", device="cpu", warmup: int = 2, repeats: int = 5) -> float:
    """Achieved GFLOP/s of an n x n matmul in ``precision`` on ``device``: the fastest of ``repeats``.

    A microbenchmark asks what rate the kernel *can* reach, so it keeps the best run:
    anything else running on the machine only ever adds time. (Training steps, which
    include more than one kernel, are read as medians instead.) tf32 is float32 tensors
    under ``set_float32_matmul_precision("high")``; check ``hardware.supported_precisions``
    first: on a CPU tf32 runs as plain fp32. Used by ``bench``, lesson 00's measured
    recommendation (``hardware.matmul_speedups``) and 05.
    """
    name = parse_precision(precision)
    device = torch.device(device)
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, generator=g).to(dtype_of(name))
    b = torch.randn(n, n, device=device, generator=g).to(dtype_of(name))
    with float32_matmul_precision(name):
        timing = time_step(lambda: a @ b, device, warmup=warmup, repeats=repeats)
    return matmul_flops(n) / (timing.min_ms * 1e-3) / 1e9



def available_memory(device) -> int | None:
    """Bytes free for new tensors on ``device`` (``None`` if the platform does not say)."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    if device.type != "cpu":
        return None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


# -- what a batch costs: the memory of a whole training step, by kind ------------------------


@dataclass(frozen=True)
class TrainingMemory:
    """Bytes a training step holds, by kind, for one precision and batch; ``total`` is their sum,
    not a measured peak.

    ``input_batch`` is the batch ``(x, y)`` the step is given, in its own dtypes, counted
    once in every precision: where autograd saves ``x`` itself (fp32's first matmul) it is
    not counted again in ``activations``; autocast's 16-bit copy of it is an activation.
    Only ``input_batch`` and ``activations`` grow with the batch, and only ``activations``
    (and ``weight_copies``) depend on the precision: the input batch, the float32 weights,
    their gradients and the optimizer state stay as they are under autocast. Short-lived temporaries (activation gradients, kernel
    workspaces) are not in the sum; ``cuda_peak`` (CUDA only) is the allocator's peak of
    one real step, which includes them.
    """

    precision: str
    batch: int
    weights: int
    gradients: int
    optimizer_state: int
    weight_copies: int
    input_batch: int
    activations: int
    cuda_peak: int | None = None

    @property
    def total(self) -> int:
        return (self.weights + self.gradients + self.optimizer_state + self.weight_copies + self.input_batch
                + self.activations)


def optimizer_state_bytes(model: nn.Module, optimizer=torch.optim.AdamW) -> int:
    """Bytes of the state ``optimizer`` keeps for ``model`` (AdamW: two moments per weight),
    counted after one step on a copy: the model itself is not touched."""
    twin = copy.deepcopy(model)
    params = [p for p in twin.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.zeros_like(p)
    opt = optimizer(params)
    opt.step()
    return sum(t.numel() * t.element_size() for state in opt.state.values() for t in state.values()
               if isinstance(t, torch.Tensor))


def training_memory(model: nn.Module, x: torch.Tensor, y: torch.Tensor, precision="fp32",
                    optimizer=torch.optim.AdamW, loss_fn=nn.functional.cross_entropy,
                    optimizer_bytes: int | None = None) -> TrainingMemory:
    """What one training step of ``model`` on the batch ``(x, y)`` in ``precision`` holds, by kind.

    Activations and weight copies come from :func:`saved_memory` (exact on every device),
    less the saved tensors that are ``x`` or ``y`` themselves, which ``input_batch`` counts;
    weights and gradients from the parameters; the optimizer state from one step of
    ``optimizer`` on a copy. On CUDA, ``cuda_peak`` adds the allocator's peak of one
    real step on a copy (weights included). Used in 05_putting_it_together.
    """
    name = parse_precision(precision)
    saved = saved_memory(model, x, y, name, loss_fn)
    params = list(model.parameters())
    weights = sum(p.numel() * p.element_size() for p in params)
    grads = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
    state = optimizer_state_bytes(model, optimizer) if optimizer_bytes is None else optimizer_bytes
    peak = None
    if x.device.type == "cuda":
        twin = copy.deepcopy(model)
        opt = optimizer([p for p in twin.parameters() if p.requires_grad])

        def step():
            with torch.autocast("cuda", dtype=dtype_of(name), enabled=uses_autocast(name)), \
                    float32_matmul_precision(name):
                loss = loss_fn(twin(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        measured = cuda_peak_memory(step, x.device)
        peak = measured.peak_bytes - measured.before_bytes + weights
        del twin, opt
    batch_bytes = x.numel() * x.element_size() + y.numel() * y.element_size()
    return TrainingMemory(name, len(x), weights, grads, state, saved.weight_copy_bytes, batch_bytes,
                          saved.activation_bytes - saved.input_bytes, peak)


@dataclass
class BatchCost:
    """:func:`doubled_batch`'s measurements: per precision, the step at ``batch`` and at twice it."""

    batch: int
    rows: dict[str, tuple[TrainingMemory, TrainingMemory]]
    device: str = "cpu"

    def largest_batch(self, precision: str, budget: int) -> int:
        """The largest batch whose step holds at most ``budget`` bytes in ``precision``.

        Only the activations grow with the batch, by the same bytes per example, so the
        two measured batches give the line; the answer is exact, not a float estimate.
        """
        one, two = self.rows[parse_precision(precision)]
        per_batch = two.total - one.total  # bytes that ``batch`` more examples add
        if per_batch <= 0:
            raise ValueError("the activations did not grow with the batch: no batch size can be derived")
        return max(0, self.batch + (budget - one.total) * self.batch // per_batch)

    def batch_in_fp32_memory(self, precision: str) -> int:
        """The largest batch ``precision`` fits in the bytes fp32 holds at :attr:`batch`."""
        return self.largest_batch(precision, self.rows["fp32"][0].total)

    def table(self) -> str:
        """Bytes by kind at the batch and at twice it, in MiB (exact counts, not timings)."""
        head = (f"{'precision':<10}{'weights':>9}{'grads':>8}{'optimizer':>10}{'16-bit':>8}{'batch':>7}"
                f"{'activations':>12}{'total':>9}{'x2 batch':>10}{'added':>8}")
        lines = [f"MiB a training step holds, summed by kind (not a measured peak), batch {self.batch} "
                 f"and {2 * self.batch}", head]
        for p, (one, two) in self.rows.items():
            lines.append(f"{p:<10}{one.weights / MiB:>9.2f}{one.gradients / MiB:>8.2f}"
                         f"{one.optimizer_state / MiB:>10.2f}{one.weight_copies / MiB:>8.2f}{one.input_batch / MiB:>7.2f}"
                         f"{one.activations / MiB:>12.2f}{one.total / MiB:>9.2f}{two.total / MiB:>10.2f}"
                         f"{(two.total - one.total) / MiB:>8.2f}")
        return "\n".join(lines)

    def ratio_limit(self, precision: str) -> float:
        """The batch ratio ``precision`` fits in fp32's memory as the batch grows without end:
        fp32's bytes per example over ``precision``'s (the weights' share vanishes). Exact
        byte counts: under 2 wherever the step holds bytes that do not halve (the input batch,
        the loss's float32)."""
        one, two = self.rows["fp32"]
        mine, mine2 = self.rows[parse_precision(precision)]
        return (two.total - one.total) / (mine2.total - mine.total)

    def fits_lines(self) -> list[str]:
        """For each 16-bit precision: the largest batch it fits in fp32's memory at :attr:`batch`."""
        budget = self.rows["fp32"][0].total
        out = []
        for p in self.rows:
            if p == "fp32":
                continue
            n = self.batch_in_fp32_memory(p)
            verdict = "not 2x" if n < 2 * self.batch else "2x or more"
            out.append(f"in the {budget / MiB:.2f} MiB fp32 holds at batch {self.batch}, {p} fits batch "
                       f"{n}, {n / self.batch:.2f}x as large: {verdict}")
        return out

    def peak_line(self) -> str:
        """The allocator's peak of one step per precision on CUDA; on other devices, why not."""
        peaks = {p: one.cuda_peak for p, (one, _) in self.rows.items() if one.cuda_peak is not None}
        if not peaks:
            return (f"peak memory of a whole step: GPU only (on {self.device}, torch keeps no peak "
                    "counter); the bytes above are what the step holds, counted exactly on any device")
        return "CUDA peak of one step, weights included: " + ", ".join(
            f"{p} {v / MiB:.1f} MiB" for p, v in peaks.items())


def doubled_batch(model: nn.Module, x: torch.Tensor, y: torch.Tensor, precisions=("fp32", "bf16", "fp16"),
                  optimizer=torch.optim.AdamW, loss_fn=nn.functional.cross_entropy) -> BatchCost:
    """What the batch ``(x, y)`` and a batch twice as large cost in each precision, by kind.

    The card says activations take half the memory in 16 bits. A batch twice as large
    does not fit where fp32's did, because the weights, gradients, optimizer state and the
    input batch stay as they are and autocast adds 16-bit weight copies: :meth:`BatchCost.fits_lines`
    says how large a batch does fit. Used in 05_putting_it_together.
    """
    names = list(dict.fromkeys(["fp32", *(parse_precision(p) for p in precisions)]))
    state = optimizer_state_bytes(model, optimizer)
    x2, y2 = torch.cat([x, x]), torch.cat([y, y])
    rows = {p: (training_memory(model, x, y, p, optimizer, loss_fn, state),
                training_memory(model, x2, y2, p, optimizer, loss_fn, state)) for p in names}
    return BatchCost(len(x), rows, str(x.device))
