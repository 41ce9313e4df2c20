"""Recipes are frozen, hashable, validated dataclasses."""

import dataclasses

import pytest
import torch

from fp8graph import DelayedScaling, Float8CurrentScaling, Format
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


def test_delayed_margin_is_bounded_where_the_amax_would_cast_to_almost_nothing():
    """margin m maps the amax to 448 / 2**m: at 16 it is 0.0068, a few steps above E4M3's smallest subnormal
    (2**-9); at 17 and beyond the cast keeps next to nothing (margin=100 made the outputs non-finite)."""
    assert DelayedScaling(margin=16).margin == 16
    for margin in (-1, 17, 100, 1024):
        with pytest.raises(ValueError, match=r"DelayedScaling\.margin must be in \[0, 16\] for HYBRID"):
            DelayedScaling(margin=margin)


def _item_of_max(history):
    return history.max().item()


@pytest.mark.parametrize("algo,message", [
    (lambda history: "max", r"must return one amax .* got 'max'"),
    (lambda history: history * 2, r"must return one amax .* got a torch.float32 tensor of shape \(4,\)"),
    (_item_of_max, r"'_item_of_max' must be tensor code the graph can run .*DataDependentOutputException"),
])
def test_a_custom_amax_algorithm_is_tried_on_a_history_when_the_recipe_is_made(algo, message):
    with pytest.raises(ValueError, match=message):
        DelayedScaling(amax_compute_algo=algo)
    assert DelayedScaling(amax_compute_algo=lambda history: history[:2].mean()).amax_history_len == 1024
