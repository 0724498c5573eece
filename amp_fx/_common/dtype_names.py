"""One spelling of dtype names in everything amp_fx prints: bf16, fp16, fp32, fp64, i64, bool."""

from __future__ import annotations

import torch

__all__ = ["dtype_name"]

_NAMES = {
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float32: "fp32",
    torch.float64: "fp64",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.int16: "i16",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.bool: "bool",
    torch.complex64: "c64",
    torch.complex128: "c128",
}


def dtype_name(dtype: torch.dtype | None) -> str:
    """``bf16`` for torch.bfloat16, ``fp32`` for torch.float32, ``-`` for None; other dtypes as
    torch names them without the ``torch.`` prefix (``float8_e4m3fn``)."""
    if dtype is None:
        return "-"
    return _NAMES.get(dtype, str(dtype).replace("torch.", ""))
