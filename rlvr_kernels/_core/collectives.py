"""The collectives of every ``process_group=`` path, and the one cross-rank handshake.

Every op that takes a ``process_group`` first runs :func:`handshake`: ONE all-reduce (SUM)
of a ``[world, 1 + k]`` fp64 table in which each rank fills only its own row (a status,
then k named fields). Adding zeros to one value is exact, so every rank receives every
rank's row bitwise: an all-gather that also carries device tensors (``policy_loss``'s token
and sequence counts) without a host sync. Then, on the host and the same on every rank:

- a rank whose own argument checks failed joins the handshake with a failure status and
  raises its own error; every other rank raises a ``RuntimeError`` naming it, so no rank
  is left waiting in a later collective;
- a field that every rank must pass the same (a count, an options fingerprint) is compared
  with rank 0's; the first rank that differs is named in a ``ValueError``.

Fields that only travel (this rank's counts, its vocabulary shard size) are read by the
caller from the returned table. The collectives themselves are eager only
(:func:`check_eager`): torch.compile does not trace them.
"""

from __future__ import annotations

import dataclasses
import zlib
from typing import List, Optional, Sequence

import torch

# The status column of the handshake table (0 would be a rank that never wrote its row).
OK, FAILED = 1.0, 2.0

_REDUCE_OPS = ("sum", "max", "min")


@dataclasses.dataclass(frozen=True)
class Field:
    """One column of the handshake table.

    ``name``: how the errors name it (an argument, or a description of a fingerprint);
    ``agree``: every rank must pass the same value; ``show``: the errors print the values
    (not for fingerprints); ``hint``: what the caller should do, appended to the error."""

    name: str
    agree: bool = True
    show: bool = True
    hint: str = ""


def fingerprint(*values) -> int:
    """crc32 of the values' repr: the same on every process (unlike ``hash()``) and exact
    in fp64."""
    return zlib.crc32(repr(values).encode())


def check_eager(op: str, hint: str = "") -> None:
    """Refuse torch.compile before any collective runs (it does not trace them)."""
    if torch.compiler.is_compiling():
        raise RuntimeError(
            f"{op}(process_group=...): eager only (its collectives are not traced by torch.compile){hint}"
        )


def _dist():
    import torch.distributed as dist

    if not is_initialized():
        raise RuntimeError("process_group: torch.distributed is not initialized")
    return dist


def is_initialized() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def world_size(group) -> int:
    return _dist().get_world_size(group)


def rank(group) -> int:
    return _dist().get_rank(group)


def group_name(group) -> str:
    """The name under which ``group`` is registered, for a custom op that runs collectives
    (a process group is not a schema type; the op takes the name, a str, and finds the
    group again with :func:`resolve_group`)."""
    name = getattr(group, "group_name", None)
    if not isinstance(name, str):
        raise TypeError(f"process_group: expected a torch.distributed ProcessGroup, got {type(group).__name__}")
    return name


def resolve_group(name: str):
    """The process group registered under ``name`` (:func:`group_name`)."""
    _dist()
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


def group_device(group, like: Optional[torch.Tensor] = None) -> torch.device:
    """Where this group's collectives run: ``like``'s device when given (and not meta), else
    the current CUDA device for NCCL and the CPU otherwise."""
    if isinstance(like, torch.Tensor) and like.device.type != "meta":
        return like.device
    if _dist().get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce(tensor: torch.Tensor, group, op: str = "sum") -> torch.Tensor:
    """In-place all-reduce of ``tensor`` over ``group`` (``op``: "sum", "max" or "min");
    returns ``tensor``."""
    dist = _dist()
    if op not in _REDUCE_OPS:
        raise ValueError(f"op: expected one of {_REDUCE_OPS}, got {op!r}")
    reduce_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op]
    dist.all_reduce(tensor, op=reduce_op, group=group)
    return tensor


def all_gather(tensor: torch.Tensor, group) -> List[torch.Tensor]:
    """Every rank's ``tensor`` (same shape on every rank), in rank order."""
    dist = _dist()
    out = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, tensor, group=group)
    return out


def handshake(
    op: str,
    group,
    fields: Sequence[Field],
    values: Optional[Sequence],
    *,
    device: torch.device,
    check: bool = True,
    arg: str = "process_group",
) -> Optional[torch.Tensor]:
    """The cross-rank handshake of ``op`` (module docstring): one all-reduce, then, with
    ``check``, the status and agreement checks on the host (a sync on CUDA).

    ``values``: this rank's value of each field (Python numbers, or 0-d tensors that stay on
    the device), or None when this rank failed its own checks: it joins, gets None back and
    its caller raises its own error. Returns the ``[world, len(fields)]`` fp64 table of
    every rank's fields on ``device``; ``arg`` names the group argument in the errors.
    Without ``check`` the table is not read (no host sync): a failed rank or a disagreement
    then goes unnoticed by the others, so only a caller that runs no further collective
    may skip it."""
    dist = _dist()
    world, me = dist.get_world_size(group), dist.get_rank(group)
    table = torch.zeros((world, 1 + len(fields)), dtype=torch.float64, device=device)
    if values is None:
        table[me, 0] = FAILED
    else:
        if len(values) != len(fields):
            raise ValueError(f"values: expected {len(fields)} (one per field), got {len(values)}")
        # Host values in one copy; the tensors on the device, one slot each.
        host = [0.0 if isinstance(v, torch.Tensor) else float(v) for v in (OK, *values)]
        table[me] = torch.tensor(host, dtype=torch.float64).to(device)
        for slot, v in enumerate(values, 1):
            if isinstance(v, torch.Tensor):
                table[me, slot] = v.detach().reshape(()).to(device, torch.float64)
    dist.all_reduce(table, op=dist.ReduceOp.SUM, group=group)
    if values is None:
        return None
    if check:
        _check_rows(f"{op}({arg})", fields, table.tolist())
    return table[:, 1:]


def _check_rows(op: str, fields: Sequence[Field], rows) -> None:
    """The checks every rank runs on the same rows, so every rank raises the same error."""
    failed = [r for r, row in enumerate(rows) if row[0] != OK]
    if failed:
        raise RuntimeError(
            f"{op}: rank(s) {failed} of the process group failed their own argument checks "
            f"(see the error raised there); every rank stops here"
        )
    for slot, field in enumerate(fields, 1):
        if not field.agree:
            continue
        r = next((r for r, row in enumerate(rows) if row[slot] != rows[0][slot]), None)
        if r is None:
            continue
        hint = f"; {field.hint}" if field.hint else ""
        if field.show:
            raise ValueError(
                f"{field.name}: differs between rank 0 ({rows[0][slot]:g}) and rank {r} ({rows[r][slot]:g}) "
                f"of the process group{hint}"
            )
        raise ValueError(f"{op}: {field.name} differ between rank 0 and rank {r}{hint}")
