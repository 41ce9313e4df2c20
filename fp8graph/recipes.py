"""Scaling recipes: how each FP8 cast of a linear site picks its scale.

A recipe is a frozen dataclass. It holds no state and is hashable, so it can
key caches and be compared; variations are made with ``dataclasses.replace``.
"""

from __future__ import annotations

import dataclasses

from .formats import Format, Role

__all__ = ["Float8CurrentScaling", "Recipe"]


def _check_type(recipe: object, field: str, expected: type) -> None:
    value = getattr(recipe, field)
    # bool is an int subclass: reject it where an int is asked for, and vice versa.
    if not isinstance(value, expected) or (expected is not bool and isinstance(value, bool)):
        raise ValueError(
            f"{type(recipe).__name__}.{field} must be {expected.__name__}, got {value!r}"
        )


@dataclasses.dataclass(frozen=True)
class Float8CurrentScaling:
    """Per-tensor current scaling.

    Each tensor is scaled by its own amax at the moment it is cast::

        scale = fp8_max / amax(tensor)         (1 when amax is 0, inf or NaN)
        tensor_fp8 = round_to_nearest_even(clamp(tensor * scale, -fp8_max, fp8_max))

    The amax costs one extra read of the tensor before the cast.

    Args:
        fp8_format: FP8 dtype per role; ``Format.HYBRID`` casts grad_output
            to E5M2 and input and weight to E4M3.
        power_2_scales: round every scale down to a power of two, so that
            scaling changes only the exponent and is exact.

    Example:
        >>> Float8CurrentScaling(fp8_format=Format.E4M3)
        Float8CurrentScaling(fp8_format=<Format.E4M3: 'E4M3'>, power_2_scales=False)
    """

    fp8_format: Format = Format.HYBRID
    power_2_scales: bool = False

    def __post_init__(self) -> None:
        _check_type(self, "fp8_format", Format)
        _check_type(self, "power_2_scales", bool)

    @property
    def name(self) -> str:
        """Short label for reports, e.g. ``current(HYBRID)``."""
        suffix = ", pow2" if self.power_2_scales else ""
        return f"current({self.fp8_format.value}{suffix})"

    def fp8_dtype(self, role: Role):
        return self.fp8_format.dtype(role)


# The recipes a site can be given; later recipes join this union.
Recipe = Float8CurrentScaling
