"""Input checks shared by the ops: each error names the argument, what was expected and
what arrived. Type and dtype problems raise TypeError, shapes/devices/ranges ValueError."""

from __future__ import annotations

from typing import Optional, Sequence

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)
MASK_DTYPES = (torch.bool,) + INT_DTYPES + FLOAT_DTYPES


def _dtype_names(dtypes) -> str:
    return "/".join(str(d).replace("torch.", "") for d in dtypes)


def check_tensor(
    name: str,
    x,
    *,
    dtypes: Sequence[torch.dtype],
    ndim: Optional[Sequence[int]] = None,
    device: Optional[torch.device] = None,
) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in dtypes:
        raise TypeError(f"{name}: expected dtype {_dtype_names(dtypes)}, got {str(x.dtype).replace('torch.', '')}")
    if ndim is not None and x.dim() not in ndim:
        want = " or ".join(f"{d}-D" for d in ndim)
        raise ValueError(f"{name}: expected a {want} tensor, got shape {tuple(x.shape)}")
    if device is not None and x.device != device:
        raise ValueError(f"{name}: expected a tensor on {device} (where scores live), got {x.device}")
    return x


def check_shape(name: str, x: torch.Tensor, shape: Sequence[int], what: str) -> None:
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)} ({what}), got {tuple(x.shape)}")


def check_int(name: str, value, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value}")
    return value


def check_out_dtype(out_dtype) -> torch.dtype:
    if out_dtype not in FLOAT_DTYPES:
        raise TypeError(f"out_dtype: expected one of {_dtype_names(FLOAT_DTYPES)}, got {out_dtype!r}")
    return out_dtype


def checks_enabled(validate: bool) -> bool:
    """Value checks read tensor data (a host sync on CUDA). They are skipped under
    torch.compile, where a sync would break the graph; kernels stay bounds-safe."""
    return validate and not torch.compiler.is_compiling()


def fail_if(condition: torch.Tensor, message: str) -> None:
    if bool(condition):
        raise ValueError(message)
