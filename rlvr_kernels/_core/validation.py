"""Input checks shared by every op: each error names the argument, what was expected and
what arrived. Type and dtype problems raise TypeError; shapes, devices, ranges and sizes
raise ValueError.

Two kinds of check:
- static checks (types, dtypes, shapes, devices, Python numbers) always run: they read no
  tensor data;
- value checks read tensor data (a host sync on CUDA), run when the caller's
  ``validate=True`` and :func:`checks_enabled` agrees (not under torch.compile, not on meta
  tensors). The kernels stay in bounds when they are skipped (``csrc/spans.h``).
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np
import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)
INDEX_DTYPES = (torch.int32, torch.int64)
MASK_DTYPES = (torch.bool,) + INT_DTYPES + FLOAT_DTYPES

# The largest count (tokens, groups, rows) a call may ask the kernels to allocate or index:
# the Triton kernels index groups and rows with int32, and anything larger than this is a
# caller's mistake (a garbage id or offset) long before it is a real batch.
MAX_COUNT = 2**31 - 1

# Temperatures the kernels represent: z / T is formed in fp32, so 1 / T must be a normal
# fp32 number; at the smallest T, z / T stays finite for logits up to ~3e8 in magnitude
# (fp32's max 3.4e38 / 1e30), far beyond any real model's logits.
MIN_TEMPERATURE = 1e-30
MAX_TEMPERATURE = 1e30

# linear_logprobs' logit_scale (its magnitude, unless 0) and softcap: the kernels read them
# folded with the temperature into fp32 factors, logit_scale/T or softcap/T per row and the
# tanh's scale logit_scale/softcap (where 0 means "no soft-cap"). With both in this range
# and T in [MIN_TEMPERATURE, MAX_TEMPERATURE] every factor, and the backward's product
# (logit_scale/softcap)·(softcap/T), lies in [1e-36, 1e36]: a normal fp32 number, never 0
# or inf, whatever the logits; far beyond real heads' values (about 0.06 to 50).
MIN_LOGIT_FACTOR = 1e-6
MAX_LOGIT_FACTOR = 1e6


def _dtype_names(dtypes) -> str:
    return "/".join(str(d).replace("torch.", "") for d in dtypes)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def check_tensor(
    name: str,
    x,
    *,
    dtypes: Sequence[torch.dtype],
    ndim: Optional[Sequence[int]] = None,
    like: Optional[torch.Tensor] = None,
    like_name: Optional[str] = None,
    device: Optional[torch.device] = None,
) -> torch.Tensor:
    """``x`` is a tensor of one of ``dtypes`` with one of ``ndim`` dimensions, on the device
    of ``like`` (whose argument name is ``like_name``) or on ``device`` when given."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in dtypes:
        raise TypeError(f"{name}: expected dtype {_dtype_names(dtypes)}, got {dtype_name(x.dtype)}")
    if ndim is not None and x.dim() not in ndim:
        want = " or ".join(f"{d}-D" for d in ndim)
        raise ValueError(f"{name}: expected a {want} tensor, got shape {tuple(x.shape)}")
    if like is not None:
        check_device(name, x, like, like_name)
    if device is not None and x.device != device:
        raise ValueError(f"{name}: expected a tensor on {device}, got {x.device}")
    return x


def check_device(name: str, x: torch.Tensor, like: torch.Tensor, like_name: Optional[str]) -> None:
    if x.device != like.device:
        where = f" (where {like_name} lives)" if like_name else ""
        raise ValueError(f"{name}: expected a tensor on {like.device}{where}, got {x.device}")


def check_like(name: str, x, like: torch.Tensor, like_name: str, *, dtypes: Sequence[torch.dtype]) -> torch.Tensor:
    """``x`` is a tensor of ``dtypes`` with the shape and device of ``like``."""
    check_tensor(name, x, dtypes=dtypes, like=like, like_name=like_name)
    if tuple(x.shape) != tuple(like.shape):
        raise ValueError(f"{name}: expected shape {tuple(like.shape)} (like {like_name}), got {tuple(x.shape)}")
    return x


def check_shape(name: str, x: torch.Tensor, shape: Sequence[int], what: str) -> None:
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)} ({what}), got {tuple(x.shape)}")


def check_bools(**flags) -> None:
    """Each keyword a bool (TypeError naming the first that is not)."""
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"{name}: expected a bool, got {type(value).__name__}")


def check_int(name: str, value, *, minimum: int, maximum: int = MAX_COUNT) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value}")
    if value > maximum:
        raise ValueError(f"{name}: expected an int <= {maximum}, got {value}")
    return value


def check_number(
    name: str, value, *, minimum: float = -math.inf, maximum: float = math.inf, open_low: bool = False
) -> float:
    """A finite Python number in [minimum, maximum] (or (minimum, maximum] with ``open_low``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}: expected a number, got {type(value).__name__}")
    low_ok = value > minimum if open_low else value >= minimum
    if not (math.isfinite(value) and low_ok and value <= maximum):
        bracket = "(" if open_low else "["
        raise ValueError(f"{name}: expected a finite number in {bracket}{minimum}, {maximum}], got {value!r}")
    return float(value)


def check_has_data(name: str, x: torch.Tensor) -> torch.Tensor:
    """``x`` holds data to read: a meta tensor (a shape without values) is refused, for the
    host-side code that copies its values (packing)."""
    if x.device.type == "meta":
        raise ValueError(f"{name}: expected a tensor with data, got a meta tensor (it holds no values to read)")
    return x


def numpy_to_tensor(name: str, x: np.ndarray, what: str = "numbers") -> torch.Tensor:
    """A numpy array of numbers as a CPU tensor (sharing its memory when contiguous); an array
    torch cannot hold (object, str, datetime dtypes) raises TypeError naming ``name``."""
    try:
        return torch.from_numpy(np.ascontiguousarray(x))
    except (TypeError, ValueError):
        raise TypeError(f"{name}: expected {what}, got a numpy array of dtype {x.dtype}") from None


def check_out_dtype(out_dtype) -> torch.dtype:
    if out_dtype not in FLOAT_DTYPES:
        raise TypeError(f"out_dtype: expected one of {_dtype_names(FLOAT_DTYPES)}, got {out_dtype!r}")
    return out_dtype


def checks_enabled(validate: bool, *tensors: Optional[torch.Tensor]) -> bool:
    """Whether to run value checks. They read tensor data (a host sync on CUDA), so they are
    skipped under torch.compile, where a sync would break the graph, and for meta tensors,
    which hold no data; kernels stay bounds-safe without them."""
    if not validate or torch.compiler.is_compiling():
        return False
    return not any(t is not None and t.device.type == "meta" for t in tensors)


def fail_if(condition: torch.Tensor, message: str) -> None:
    if bool(condition):
        raise ValueError(message)


def check_cu_seqlens(
    cu_seqlens,
    *,
    like: torch.Tensor,
    like_name: str,
    num_seqs: Optional[int] = None,
    num_tokens: Optional[int] = None,
    total: str = "at_most",
    validate: bool = True,
) -> torch.Tensor:
    """The packed layout's offsets: a 1-D int32/int64 tensor of B + 1 >= 1 entries on
    ``like``'s device (B = ``num_seqs`` when given). With value checks on:
    cu_seqlens[0] == 0, non-decreasing, and cu_seqlens[-1] <= T (``total="at_most"``) or
    == T (``total="equal"``) for T = ``num_tokens``; without a T, cu_seqlens[-1] is the
    token count and must not exceed :data:`MAX_COUNT`. Returns the offsets as int64."""
    check_tensor("cu_seqlens", cu_seqlens, dtypes=INDEX_DTYPES, ndim=(1,), like=like, like_name=like_name)
    if cu_seqlens.shape[0] < 1:
        raise ValueError("cu_seqlens: expected B + 1 >= 1 offsets, got an empty tensor")
    if num_seqs is not None and cu_seqlens.shape[0] != num_seqs + 1:
        raise ValueError(f"cu_seqlens: expected shape ({num_seqs + 1},) (B + 1 offsets), got {tuple(cu_seqlens.shape)}")
    cu = cu_seqlens.long()
    if checks_enabled(validate, cu):
        first, last = int(cu[0]), int(cu[-1])
        if first != 0:
            raise ValueError(f"cu_seqlens: expected cu_seqlens[0] == 0, got {first}")
        if cu.numel() > 1 and bool((cu[1:] < cu[:-1]).any()):
            i = int((cu[1:] < cu[:-1]).nonzero()[0, 0])
            raise ValueError(f"cu_seqlens: expected non-decreasing offsets, got {int(cu[i])} then {int(cu[i + 1])}")
        if num_tokens is None:
            if last > MAX_COUNT:
                raise ValueError(f"cu_seqlens: expected cu_seqlens[-1] <= {MAX_COUNT} tokens, got {last}")
        elif total == "equal" and last != num_tokens:
            raise ValueError(f"cu_seqlens: expected cu_seqlens[-1] == T = {num_tokens}, got {last}")
        elif last > num_tokens:
            raise ValueError(f"cu_seqlens: expected cu_seqlens[-1] <= T = {num_tokens}, got {last}")
    return cu


def check_finite(name: str, x: torch.Tensor, valid: Optional[torch.Tensor] = None) -> None:
    """No NaN/±inf in ``x`` (where ``valid``, if given); the error names the first index.
    A value check: call it only when :func:`checks_enabled`."""
    bad = ~torch.isfinite(x)
    if valid is not None:
        bad = bad & valid
    if x.numel() and bool(bad.any()):
        idx = tuple(int(v) for v in bad.nonzero()[0])
        where = " on a valid token" if valid is not None else ""
        raise ValueError(f"{name}: non-finite value {float(x[idx])} at {idx}{where}")


def check_temperature(temperature, rows_shape: Sequence[int], like: torch.Tensor, like_name: str, validate: bool):
    """A float, or a tensor broadcastable to ``rows_shape`` (one per row), in
    [:data:`MIN_TEMPERATURE`, :data:`MAX_TEMPERATURE`]: the range whose reciprocal the
    kernels represent. Returns the float or the tensor broadcast to ``rows_shape``."""
    if isinstance(temperature, torch.Tensor):
        check_tensor("temperature", temperature, dtypes=FLOAT_DTYPES, like=like, like_name=like_name)
        try:
            out = torch.broadcast_to(temperature.detach(), tuple(rows_shape))
        except RuntimeError:
            raise ValueError(
                f"temperature: expected a float or a tensor broadcastable to {tuple(rows_shape)} "
                f"(one per row), got shape {tuple(temperature.shape)}"
            ) from None
        if checks_enabled(validate, temperature) and temperature.numel():
            t = temperature.detach().double()
            # The bounds as the tensor's dtype rounds them (fp32's nearest to 1e30 is above it).
            slack = torch.finfo(temperature.dtype).eps
            bad = ~((t >= MIN_TEMPERATURE * (1 - slack)) & (t <= MAX_TEMPERATURE * (1 + slack)))
            if bool(bad.any()):
                idx = tuple(int(v) for v in bad.nonzero()[0])
                raise ValueError(
                    f"temperature: expected values in [{MIN_TEMPERATURE}, {MAX_TEMPERATURE}], "
                    f"got {float(t[idx])} at {idx}"
                )
        return out
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise TypeError(f"temperature: expected a float or a tensor, got {type(temperature).__name__}")
    return check_number("temperature", temperature, minimum=MIN_TEMPERATURE, maximum=MAX_TEMPERATURE)
