"""FP8 formats and the tensor roles of a linear layer.

A linear site has three operands that get their own scale: ``input`` and
``weight`` in the forward GEMM, and ``grad_output`` in the two backward GEMMs.
A :class:`Format` says which FP8 dtype each role is cast to.
"""

from __future__ import annotations

import enum

import torch

__all__ = ["Format", "ROLES", "Role", "fp8_max", "fp8_max_exponent", "is_fp8", "saturation_threshold"]


class Role(str, enum.Enum):
    """The operand of a linear site a tensor plays."""

    INPUT = "input"
    WEIGHT = "weight"
    GRAD_OUTPUT = "grad_output"


# The order in which per-role state and statistics are stored (row 0, 1, 2).
ROLES = (Role.INPUT, Role.WEIGHT, Role.GRAD_OUTPUT)


class Format(enum.Enum):
    """Which FP8 dtype each role uses.

    ``E4M3``: every role in E4M3 (max 448, 3 mantissa bits).
    ``HYBRID``: E4M3 for input and weight, E5M2 (max 57344, 2 mantissa bits)
    for grad_output, whose range matters more than its precision.
    """

    E4M3 = "E4M3"
    HYBRID = "HYBRID"

    def dtype(self, role: Role) -> torch.dtype:
        if self is Format.HYBRID and role is Role.GRAD_OUTPUT:
            return torch.float8_e5m2
        return torch.float8_e4m3fn


_FP8_MAX = {
    torch.float8_e4m3fn: torch.finfo(torch.float8_e4m3fn).max,  # 448
    torch.float8_e5m2: torch.finfo(torch.float8_e5m2).max,  # 57344
}


def is_fp8(dtype: torch.dtype) -> bool:
    """Whether ``dtype`` is one of the FP8 dtypes fp8graph writes."""
    return dtype in _FP8_MAX


def fp8_max(fp8_dtype: torch.dtype) -> float:
    """Largest finite value of an FP8 dtype."""
    try:
        return _FP8_MAX[fp8_dtype]
    except KeyError:
        raise ValueError(f"{fp8_dtype} is not a supported FP8 dtype") from None


def fp8_max_exponent(fp8_dtype: torch.dtype) -> int:
    """``p`` with ``fp8_max = 1.75 * 2**p``: 8 for E4M3 (448), 15 for E5M2 (57344)."""
    return int(fp8_max(fp8_dtype) / 1.75).bit_length() - 1


# Magnitudes above max but below max + half the top step round to max even
# without saturation; only beyond this does the cast clip information.
_SATURATION_THRESHOLD = {
    torch.float8_e4m3fn: 448.0 + 16.0,  # top step 416 -> 448 is 32
    torch.float8_e5m2: 57344.0 + 4096.0,  # top step 49152 -> 57344 is 8192
}


def saturation_threshold(fp8_dtype: torch.dtype) -> float:
    """Magnitude beyond which a cast to ``fp8_dtype`` saturates rather than rounds."""
    return _SATURATION_THRESHOLD[fp8_dtype]
