"""Which dtype a kernel's matrix products run in, and Triton's names for torch's dtypes."""
from __future__ import annotations

import torch
import triton.language as tl

_TRITON_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def triton_dtype(dtype: torch.dtype) -> tl.dtype:
    """Triton's name for a float dtype the kernels take (fp8 included)."""
    return tl.float8e4nv if dtype == torch.float8_e4m3fn else _TRITON_DTYPES[dtype]


def dot_dtype(tensor: torch.Tensor) -> tl.dtype:
    """The input dtype on a GPU. On CPU tensors the kernels run under Triton's interpreter, which stores
    bfloat16 as raw 16-bit integers and has no bfloat16 arithmetic, so bfloat16 operands go up to float32."""
    if tensor.dtype == torch.bfloat16 and tensor.device.type == "cpu":
        return tl.float32
    return triton_dtype(tensor.dtype)
