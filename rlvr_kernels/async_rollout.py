"""Asynchronous rollouts with policy versions (docs/async-rollouts.md): version stamps, staleness, drop or
correct masks and per-batch staleness statistics as tensors, plus a bounded-lag producer
that generates in a background thread.

Versions count applied optimizer updates: version 0 is the initial weights, and training
step i trains at version i (after i updates). Every sample carries the versions of the
weights that generated it, ``version_min`` and ``version_max`` (they differ when a rollout
spans a weight update). At training version ``current``:

    staleness = current − version_min      (the oldest weights behind any token of the sample)

Two knobs bound it, and they are separate on purpose:

- :class:`RolloutProducer` ``max_lag`` K: generation of batch i starts only once version
  i − K is published, so every sample trained at step i has staleness ≤ K by
  construction (K = 0 is the synchronous loop). It buys throughput: generation overlaps
  training.
- :func:`staleness_mask` with :class:`StalenessOptions` ``max_lag``: what the loss accepts.
  With ``stale="drop"`` samples staler than it are masked out; with ``stale="correct"`` they
  are kept and flagged for ``policy_loss``'s rollout correction (docs/policy-loss.md). Equal to the
  producer's K it is a guard that never fires; a smaller value trades samples (drop) or
  variance (correct) for freshness.

Using the masks with the other ops (padded ``[B, L]`` layout; packed ``[T]``: expand a
per-sample flag with ``flag.repeat_interleave(lengths, output_size=T)``)::

    vmin, vmax = rollout.stamps(B)
    res = staleness_mask(vmin, vmax, step, StalenessOptions(max_lag=2, stale="correct"))
    adv = group_advantages(scores, group_index, ..., sample_mask=res.keep)  # dropped samples leave their group's stats
    mask = response_mask & res.keep[:, None]
    # "correct": old_logprobs recomputed at the training weights (version ``step``),
    # behaviour_logprobs recorded by generate (the weights that sampled each token).
    rollout_lp = torch.where(res.correct[:, None], behaviour_logprobs, old_logprobs)
    loss, metrics = policy_loss(logprobs, old_logprobs, adv.advantages, mask,
                                rollout_correction="token_tis",  # or seq_tis, token_mis, seq_mis, decoupled
                                rollout_logprobs=rollout_lp)
    log(res.stats.to_dict())

A row whose ``rollout_logprobs`` equal its ``old_logprobs`` gets the weight exp(0) = 1
under every correction (for thresholds around 1: C = ``rollout_threshold`` >= 1 and the
MIS lower bound <= 1, as the defaults 2 and 1/C), so only the flagged rows are reweighted.
Passing ``behaviour_logprobs`` for every row instead corrects every off-policy sample,
flagged or not.
"""

from __future__ import annotations

import collections
import math
import threading
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, NamedTuple, Optional, Tuple, Union

import torch

from ._core.validation import INDEX_DTYPES, check_int, check_like, check_tensor, checks_enabled

__all__ = [
    "ProducerClosed",
    "Rollout",
    "RolloutError",
    "RolloutProducer",
    "StalenessOptions",
    "StalenessResult",
    "StalenessStats",
    "staleness",
    "staleness_mask",
]

STALE_MODES = ("drop", "correct")

# The statistics hold a [max_lag + 2] histogram per step, so max_lag sizes an allocation;
# a lag this large is a mistake (a step count, an "infinite" sentinel), not a policy.
MAX_LAG = 2**16

Versions = Union[int, torch.Tensor]


# ------------------------------------------------------------------ staleness bookkeeping
@dataclass(frozen=True)
class StalenessOptions:
    """What the loss accepts: samples with staleness > ``max_lag`` are stale.

    max_lag  the largest staleness (versions behind the training version) a sample may have
             to count as fresh; 0 accepts on-policy samples only. At most :data:`MAX_LAG`.
    stale    ``"drop"``: stale samples are masked out (``keep`` False); ``"correct"``: they
             are kept and flagged (``correct`` True) for ``policy_loss``'s rollout
             correction.
    """

    max_lag: int
    stale: str = "drop"

    def __post_init__(self):
        check_int("max_lag", self.max_lag, minimum=0, maximum=MAX_LAG)
        if self.stale not in STALE_MODES:
            raise ValueError(f"stale: expected one of {STALE_MODES}, got {self.stale!r}")


class StalenessStats(NamedTuple):
    """Per-batch staleness statistics, 0-d tensors (and one histogram) on the stamps'
    device, computed without a host sync. Over every sample of the batch, kept or not; an
    empty batch gives zeros, never NaN.

    mean          mean staleness (fp32)
    max           largest staleness (int64)
    num_dropped   samples masked out (``"drop"``; 0 with ``"correct"``)
    num_stale     samples with staleness > max_lag (dropped or flagged for correction)
    num_spanning  samples whose generation spanned a weight update (version_min < version_max)
    histogram     [max_lag + 2] int64 counts: bins 0..max_lag, then one bin for > max_lag
    """

    mean: torch.Tensor
    max: torch.Tensor
    num_dropped: torch.Tensor
    num_stale: torch.Tensor
    num_spanning: torch.Tensor
    histogram: torch.Tensor

    def to_dict(self, prefix: str = "staleness/") -> Dict[str, float]:
        """Python floats for a logger, keyed ``{prefix}mean``, ..., ``{prefix}hist_0`` ..
        ``{prefix}hist_{max_lag}`` and ``{prefix}hist_overflow``. One host sync (a single
        transfer of every value)."""
        scalars = ("mean", "max", "num_dropped", "num_stale", "num_spanning")
        packed = torch.cat([torch.stack([getattr(self, k).double() for k in scalars]), self.histogram.double()])
        values = packed.tolist()
        max_lag = self.histogram.numel() - 2
        keys = [*scalars, *(f"hist_{k}" for k in range(max_lag + 1)), "hist_overflow"]
        return {prefix + k: v for k, v in zip(keys, values)}


class StalenessResult(NamedTuple):
    """:func:`staleness_mask`'s result, ``[B]`` tensors on the stamps' device.

    staleness  int64: current_version − version_min
    keep       bool: the sample enters the loss (AND it into the token mask, and pass it as
               ``group_advantages``' ``sample_mask``)
    correct    bool: the sample is stale and kept; give it the generating policy's
               log-probs as ``policy_loss``'s ``rollout_logprobs`` with a
               ``rollout_correction`` (module docstring). All False with ``"drop"``.
    stats      :class:`StalenessStats`
    """

    staleness: torch.Tensor
    keep: torch.Tensor
    correct: torch.Tensor
    stats: StalenessStats


def staleness(
    version_min: torch.Tensor, version_max: torch.Tensor, current_version: int, *, validate: bool = True
) -> torch.Tensor:
    """``current_version − version_min`` per sample: how many updates behind the training
    weights the oldest weights that produced any token of the sample are.

    Args:
        version_min: ``[B]`` int32/int64, the oldest version that generated each sample.
        version_max: ``[B]`` int32/int64, the newest (== version_min unless the rollout
            spanned a weight update); same shape and device.
        current_version: the training version (updates applied so far), an int >= 0.
        validate: check 0 <= version_min <= version_max <= current_version (reads the
            stamps: a host sync on CUDA; skipped under torch.compile and for meta tensors).

    Returns:
        ``[B]`` int64 on the stamps' device.
    """
    check_tensor("version_min", version_min, dtypes=INDEX_DTYPES, ndim=(1,))
    check_like("version_max", version_max, version_min, "version_min", dtypes=INDEX_DTYPES)
    check_int("current_version", current_version, minimum=0, maximum=torch.iinfo(torch.int64).max)
    vmin, vmax = version_min.long(), version_max.long()
    if checks_enabled(validate, vmin) and vmin.numel():
        _check_order(vmin, vmax, current_version)
    return current_version - vmin


def staleness_mask(
    version_min: torch.Tensor,
    version_max: torch.Tensor,
    current_version: int,
    options: StalenessOptions,
    *,
    validate: bool = True,
) -> StalenessResult:
    """Staleness, the keep / correct masks of ``options`` and the batch's statistics, all
    as tensors (no host sync beyond :func:`staleness`'s ``validate`` checks).

    Args:
        version_min, version_max, current_version, validate: as :func:`staleness`.
        options: :class:`StalenessOptions` (``max_lag``, ``stale``).

    Returns:
        :class:`StalenessResult` ``(staleness, keep, correct, stats)``.
    """
    if not isinstance(options, StalenessOptions):
        raise TypeError(f"options: expected a StalenessOptions, got {type(options).__name__}")
    lag = staleness(version_min, version_max, current_version, validate=validate)
    stale = lag > options.max_lag
    if options.stale == "drop":
        keep, correct = ~stale, torch.zeros_like(stale)
    else:
        keep, correct = torch.ones_like(stale), stale
    spanning = version_min.long() < version_max.long()
    return StalenessResult(lag, keep, correct, _stats(lag, stale, keep, spanning, options.max_lag))


# ------------------------------------------------------------------ bounded-lag producer
class Rollout(NamedTuple):
    """One generated batch: the user's ``data`` with the versions that generated it.

    batch_index  the training step this batch is for (0, 1, 2, ...)
    version_min  int (the whole batch) or ``[B]`` int tensor (per sample): the oldest
                 version behind the batch's / sample's tokens
    version_max  likewise, the newest (> version_min when generation spanned an update)
    data         whatever ``generate`` returned
    """

    batch_index: int
    version_min: Versions
    version_max: Versions
    data: Any

    def stamps(
        self, batch_size: Optional[int] = None, device: Optional[torch.device] = None
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(version_min, version_max)`` as ``[B]`` int64 tensors for :func:`staleness_mask`:
        batch-level int stamps are broadcast to ``batch_size`` samples (required then),
        per-sample tensors are returned as int64 (on ``device`` when given)."""
        sizes = {int(v.shape[0]) for v in (self.version_min, self.version_max) if isinstance(v, torch.Tensor)}
        if batch_size is not None:
            sizes.add(check_int("batch_size", batch_size, minimum=0))
        if len(sizes) != 1:
            what = "different sizes " + str(sorted(sizes)) if sizes else "int stamps and no batch_size"
            raise ValueError(f"batch_size: needed to broadcast the stamps to one [B], got {what}")
        (size,) = sizes

        def tensor(v):
            if isinstance(v, torch.Tensor):
                return v.to(device=device, dtype=torch.int64)
            return torch.full((size,), v, dtype=torch.int64, device=device)

        return tensor(self.version_min), tensor(self.version_max)


class ProducerClosed(RuntimeError):
    """No more batches: raised by :meth:`RolloutProducer.get` after ``close()`` or once
    ``num_batches`` batches were delivered, by ``publish()`` after ``close()``, and by the
    ``latest`` callback inside ``generate`` once the producer is closing (so a long
    generation that polls it stops early)."""


class RolloutError(RuntimeError):
    """``generate`` raised in the producer thread; the original exception is ``__cause__``
    (with its traceback). Raised by :meth:`RolloutProducer.get` for the failed batch."""


class _Failure(NamedTuple):
    batch_index: int
    error: BaseException


_END = object()  # queued after the last of num_batches batches
_DEFAULT = object()  # get(): "use the producer's timeout"

Generate = Callable[[int, Any, int, Callable[[], Tuple[int, Any]]], Any]


class RolloutProducer:
    """Generates the batches of training steps 0, 1, 2, ... in a background thread, at most
    ``max_lag`` policy versions ahead of training, into a bounded queue.

    The protocol: the trainer takes batch i with :meth:`get`, trains on it at version i,
    and calls :meth:`publish` ``(i + 1, payload)`` after the update. The producer starts
    batch i only once the latest published version v satisfies v >= i − max_lag, so every
    sample of batch i has version >= i − max_lag; it cannot be newer than i, since version
    i + 1 needs batch i trained. ``max_lag=0`` is exactly the synchronous loop (batch i
    waits for version i).

    ``generate(batch_index, payload, version, latest)`` is the user's generation: the batch
    for step ``batch_index`` with the weights ``payload`` of policy ``version``. ``latest()``
    returns the newest published ``(version, payload)``, for rollouts that pick up new
    weights mid-generation (partial rollouts); each call also checks for shutdown (raises
    :class:`ProducerClosed` once closing), so a long generation should call it now and
    then. ``generate`` returns the batch, stamped for it as
    ``Rollout(batch_index, version, newest version latest() returned, data)``; for
    per-sample stamps it returns a :class:`Rollout` itself (``[B]`` version tensors),
    checked to lie within the versions handed to it.

    Threads, not processes: generation overlaps training in one process when both are
    torch ops, which release the GIL, with no weight copies between processes. Publish a
    snapshot the trainer will not mutate (e.g. ``{k: v.detach().clone() for k, v in
    model.state_dict().items()}``): the producer reads it during the next update. Grad mode
    is thread-local, so ``generate`` runs under its own ``torch.no_grad()``. A multi-process
    or multi-GPU setup keeps this class as the bounded-lag scheduler and makes ``generate``
    a client of its rollout workers (e.g. a vLLM server): the payload is then whatever
    identifies the weights, a version number the trainer's weight sync has pushed, a
    checkpoint path; the thread only waits on I/O.

    Shutdown: use it as a context manager (or call :meth:`close`). An exception in the
    trainer's ``with`` block closes the producer and propagates; an exception in
    ``generate`` is raised by the :meth:`get` of the failed batch as :class:`RolloutError`
    (the batches before it are delivered first). The thread starts at construction.

    Args:
        generate: the generation function above.
        max_lag: K >= 0, how many versions generation may run ahead of training.
        initial_payload: the payload of version 0 (the initial weights).
        queue_size: the most finished batches waiting for the trainer; default
            ``max_lag + 1``, which never blocks the producer before the version gate does.
            A smaller queue bounds memory.
        timeout: default seconds :meth:`get` waits (None: no limit).
        num_batches: stop after this many batches (None: until closed); :meth:`get`
            raises :class:`ProducerClosed` after the last.
    """

    def __init__(
        self,
        generate: Generate,
        max_lag: int,
        *,
        initial_payload: Any,
        queue_size: Optional[int] = None,
        timeout: Optional[float] = None,
        num_batches: Optional[int] = None,
    ):
        if not callable(generate):
            raise TypeError(f"generate: expected a callable, got {type(generate).__name__}")
        self.max_lag = check_int("max_lag", max_lag, minimum=0)
        self.queue_size = max_lag + 1 if queue_size is None else check_int("queue_size", queue_size, minimum=1)
        self.timeout = _check_timeout("timeout", timeout)
        self.num_batches = None if num_batches is None else check_int("num_batches", num_batches, minimum=0)
        self._generate = generate
        # One condition guards every shared field: the published version and payload, the
        # queue and the closed flag; every change notifies all waiters, so each wait below
        # wakes on exactly the events it depends on (a publish, a get, a close), with no polling.
        self._cond = threading.Condition()
        self._version, self._payload = 0, initial_payload
        self._ready: collections.deque = collections.deque()  # Rollout, then possibly _Failure or _END
        self._closed = False
        self._next_index = 0  # the batch the next get() returns (for error messages)
        self._thread = threading.Thread(target=self._run, name="rlvr-rollout-producer", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------- trainer side
    def get(self, timeout=_DEFAULT) -> Rollout:
        """The next batch (batch indices 0, 1, 2, ... in order), waiting for it.

        ``timeout``: seconds (None: no limit); default the constructor's. Raises
        ``TimeoutError`` when nothing arrives in time, :class:`RolloutError` when
        ``generate`` failed on this batch, :class:`ProducerClosed` after ``close()`` or
        after the last of ``num_batches``."""
        timeout = self.timeout if timeout is _DEFAULT else _check_timeout("timeout", timeout)
        with self._cond:
            if not self._cond.wait_for(lambda: self._ready or self._closed, timeout):
                need = self._next_index - self.max_lag
                raise TimeoutError(
                    f"get: batch {self._next_index} did not arrive within {timeout} s (latest published version "
                    f"{self._version}; the batch starts once version >= {need}: publish() after each update)"
                )
            if self._closed:
                raise ProducerClosed("get: the producer is closed")
            item = self._ready[0]
            if isinstance(item, _Failure):  # left queued: every later get() raises it too
                raise RolloutError(f"generate failed on batch {item.batch_index}") from item.error
            if item is _END:
                raise ProducerClosed(f"get: all {self.num_batches} batches were delivered")
            self._ready.popleft()
            self._next_index += 1
            self._cond.notify_all()  # a queue slot is free
            return item

    def publish(self, version: int, payload: Any) -> None:
        """Make ``payload`` (the weights after ``version`` updates) the latest policy; the
        producer's next batches (and ``latest()`` calls) see it. Versions strictly increase."""
        check_int("version", version, minimum=0, maximum=torch.iinfo(torch.int64).max)
        with self._cond:
            if self._closed:
                raise ProducerClosed("publish: the producer is closed")
            if version <= self._version:
                raise ValueError(f"version: expected > the latest published version {self._version}, got {version}")
            self._version, self._payload = version, payload
            self._cond.notify_all()

    @property
    def version(self) -> int:
        """The latest published version."""
        with self._cond:
            return self._version

    def is_alive(self) -> bool:
        """Whether the producer thread is still running."""
        return self._thread.is_alive()

    def close(self, timeout: float = 30.0) -> None:
        """Stop the producer: wake it wherever it waits (version gate, full queue), make
        ``latest()`` raise inside a running ``generate``, and join the thread. Raises
        ``RuntimeError`` when the thread has not stopped after ``timeout`` seconds (a
        ``generate`` call that neither returns nor polls ``latest()``). Idempotent."""
        timeout = _check_timeout("timeout", timeout)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)
        if self._thread.is_alive():
            raise RuntimeError(
                f"close: the producer thread did not stop within {timeout} s (generate is still running; "
                f"calling latest() now and then lets a long generation stop at close)"
            )

    def __enter__(self) -> "RolloutProducer":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is None:
            self.close()
            return False
        try:  # the trainer's exception is the one to see; a stuck thread only warns
            self.close()
        except RuntimeError as err:
            warnings.warn(str(err), RuntimeWarning, stacklevel=2)
        return False

    # ---------------------------------------------------------------- producer thread
    def _run(self) -> None:
        index = 0
        try:
            while self.num_batches is None or index < self.num_batches:
                with self._cond:
                    # The version gate: batch `index` may use no weights older than index - max_lag.
                    self._cond.wait_for(lambda: self._closed or self._version >= index - self.max_lag)
                    if self._closed:
                        return
                    version, payload = self._version, self._payload
                newest = [version]
                out = self._generate(index, payload, version, self._latest_callback(newest))
                rollout = _stamp(index, version, newest[0], out)
                with self._cond:
                    self._cond.wait_for(lambda: self._closed or len(self._ready) < self.queue_size)
                    if self._closed:
                        return
                    self._ready.append(rollout)
                    self._cond.notify_all()
                index += 1
            self._push(_END)
        except ProducerClosed as exc:
            if not self._closed:  # generate's own, not the shutdown signal: a failure like any other
                self._push(_Failure(index, exc))
        except BaseException as exc:  # every failure, whatever its type, must reach get()
            self._push(_Failure(index, exc))

    def _push(self, item) -> None:
        # Sentinels skip the queue bound: they carry no batch, and the trainer must see them.
        with self._cond:
            self._ready.append(item)
            self._cond.notify_all()

    def _latest_callback(self, newest: list) -> Callable[[], Tuple[int, Any]]:
        def latest() -> Tuple[int, Any]:
            """The newest published ``(version, payload)``; raises ProducerClosed once closing."""
            with self._cond:
                if self._closed:
                    raise ProducerClosed("latest: the producer is closing")
                newest[0] = max(newest[0], self._version)
                return self._version, self._payload

        return latest


# ------------------------------------------------------------------ private helpers
def _check_order(vmin: torch.Tensor, vmax: torch.Tensor, current: int) -> None:
    """0 <= version_min <= version_max <= current, with one host sync for all three."""
    bad = [vmin < 0, vmin > vmax, vmax > current]
    flags = torch.stack([b.any() for b in bad]).tolist()
    if not any(flags):
        return
    k = flags.index(True)
    i = int(bad[k].nonzero()[0, 0])
    if k == 0:
        raise ValueError(f"version_min: expected versions >= 0, got {int(vmin[i])} at index {i}")
    if k == 1:
        raise ValueError(f"version_max: expected >= version_min, got {int(vmax[i])} < {int(vmin[i])} at index {i}")
    raise ValueError(f"version_max: expected <= current_version = {current}, got {int(vmax[i])} at index {i}")


def _stats(lag, stale, keep, spanning, max_lag: int) -> StalenessStats:
    n = lag.numel()
    # scatter-add into a fixed-size histogram: bincount would read the max (a host sync).
    bins = lag.clamp(0, max_lag + 1)
    hist = torch.zeros(max_lag + 2, dtype=torch.int64, device=lag.device).index_add_(0, bins, torch.ones_like(bins))
    zero = torch.zeros((), dtype=torch.int64, device=lag.device)
    return StalenessStats(
        mean=lag.to(torch.float32).sum() / max(n, 1),  # the shape, not the data: 0 for an empty batch
        max=lag.max() if n else zero,
        num_dropped=(~keep).sum(),
        num_stale=stale.sum(),
        num_spanning=spanning.sum(),
        histogram=hist,
    )


def _stamp(index: int, version: int, newest: int, out) -> Rollout:
    """The Rollout of batch ``index``: ``generate``'s own when it returned one (its stamps
    checked against the versions handed to it), else the versions handed out."""
    if not isinstance(out, Rollout):
        return Rollout(index, version, newest, out)
    if out.batch_index != index:
        raise ValueError(f"generate: returned a Rollout for batch {out.batch_index} while generating batch {index}")
    for name in ("version_min", "version_max"):
        v = getattr(out, name)
        if isinstance(v, torch.Tensor):
            check_tensor(name, v, dtypes=INDEX_DTYPES, ndim=(1,))
            lo, hi = (int(v.min()), int(v.max())) if v.numel() else (version, version)
        else:
            check_int(name, v, minimum=0, maximum=torch.iinfo(torch.int64).max)
            lo = hi = v
        if lo < version or hi > newest:
            raise ValueError(
                f"generate: the Rollout's {name} spans [{lo}, {hi}], outside the versions handed to it "
                f"[{version}, {newest}]"
            )
    vmin, vmax = torch.as_tensor(out.version_min), torch.as_tensor(out.version_max)
    if vmin.dim() and vmax.dim() and vmin.shape != vmax.shape:
        raise ValueError(
            f"generate: the Rollout's version_min {tuple(vmin.shape)} and version_max {tuple(vmax.shape)} "
            "differ in shape"
        )
    if bool((vmin > vmax.to(vmin.device)).any()):
        raise ValueError("generate: the Rollout's version_min must be <= version_max, sample by sample")
    return out


def _check_timeout(name: str, value) -> Optional[float]:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}: expected None or a number of seconds, got {type(value).__name__}")
    if math.isnan(value) or value < 0:
        raise ValueError(f"{name}: expected None or a number of seconds >= 0, got {value!r}")
    return float(value)
