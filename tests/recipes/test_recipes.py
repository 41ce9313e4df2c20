"""Recipes are frozen, hashable, validated dataclasses."""

import dataclasses

import pytest
import torch

from fp8graph import Float8CurrentScaling, Format
from fp8graph.numerics.formats import Role


def test_defaults_are_hybrid_without_power_2_scales():
    recipe = Float8CurrentScaling()
    assert recipe.fp8_format is Format.HYBRID and recipe.power_2_scales is False
    assert recipe.name == "current(HYBRID)"


@pytest.mark.parametrize("fmt,role,dtype", [
    (Format.HYBRID, Role.INPUT, torch.float8_e4m3fn),
    (Format.HYBRID, Role.WEIGHT, torch.float8_e4m3fn),
    (Format.HYBRID, Role.GRAD_OUTPUT, torch.float8_e5m2),
    (Format.E4M3, Role.GRAD_OUTPUT, torch.float8_e4m3fn),
])
def test_format_dtypes_per_role(fmt, role, dtype):
    assert Float8CurrentScaling(fp8_format=fmt).fp8_dtype(role) == dtype


@pytest.mark.parametrize("kwargs,field", [
    ({"fp8_format": "HYBRID"}, "fp8_format"),
    ({"fp8_format": None}, "fp8_format"),
    ({"power_2_scales": 1}, "power_2_scales"),
    ({"power_2_scales": "yes"}, "power_2_scales"),
])
def test_invalid_field_raises_value_error_naming_it(kwargs, field):
    with pytest.raises(ValueError, match=f"Float8CurrentScaling.{field}"):
        Float8CurrentScaling(**kwargs)


def test_frozen_hashable_and_replaceable():
    recipe = Float8CurrentScaling()
    with pytest.raises(dataclasses.FrozenInstanceError):
        recipe.power_2_scales = True
    variant = dataclasses.replace(recipe, power_2_scales=True)
    assert {recipe, variant, Float8CurrentScaling()} == {recipe, variant}
    assert variant.name == "current(HYBRID, pow2)"
