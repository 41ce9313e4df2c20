"""The FP8 decode form of expert GEMMs (weights picked per token row) against an fp64 reference and against
the grouped target the same tokens take in a prefill.

    bmm(W[ids] (S, N, K), x (S, K, 1)) -> (S, N, 1)        HF's (E, N, K) weights
    bmm(x (S, 1, K), W[ids] (S, K, N)) -> (S, 1, N)        (E, K, N) weights, fed transposed

Floor on Gaussian data: output >= 27 dB, as for the grouped GEMM's forward.
"""

import pytest
import torch

from fp8graph.gemm.scaled_gemm import Lowering
from fp8graph.numerics.health import sqnr_db
from fp8graph.recipes.scaling import DelayedScaling, Float8CurrentScaling, Float8RowwiseScaling
from fp8graph.targets.gathered import gathered_fp8_target
from fp8graph.targets.grouped import grouped_fp8_target

OUTPUT_FLOOR_DB = 27.0
RECIPES = [Float8RowwiseScaling(), Float8RowwiseScaling(power_2_scales=False), Float8CurrentScaling(),
           DelayedScaling(amax_history_len=4)]


def _case(rows=24, experts=4, depth=64, columns=96, seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, depth, generator=generator)
    weight = torch.randn(experts, columns, depth, generator=generator)
    ids = torch.randint(0, experts, (rows,), generator=generator)
    return x, weight, ids


def _state(x, weight):
    """Delayed state whose stored scales are the ones these operands' amaxes give (a decode graph only reads it)."""
    amaxes = torch.cat([x.abs().amax()[None], weight.abs().amax(dim=(1, 2))])
    return torch.zeros(1 + weight.shape[0], 4), 448 / amaxes, torch.zeros(1, 4), torch.ones(1)


def _state_args(recipe, x, weight):
    return (None, *_state(x, weight)) if recipe.stateful else ()


@pytest.mark.parametrize("recipe", RECIPES, ids=str)
def test_each_recipe_is_above_the_floor_in_both_operand_orders(recipe):
    x, weight, ids = _case()
    reference = torch.einsum("snk,sk->sn", weight.double()[ids], x.double())
    target = gathered_fp8_target(recipe, Lowering.EMULATED)
    with torch.no_grad():
        column_form = target(x[:, :, None], weight, ids, *_state_args(recipe, x, weight))  # (S, N, 1)
        # (E, K, N) weights: the rewrite feeds them as a transposed view.
        row_form = target(x[:, None, :], weight.transpose(1, 2).contiguous().transpose(1, 2), ids,
                          *_state_args(recipe, x, weight))  # (S, 1, N)
    assert column_form.shape == (24, 96, 1) and row_form.shape == (24, 1, 96)
    assert torch.equal(column_form[:, :, 0], row_form[:, 0, :])
    assert sqnr_db(reference, column_form[:, :, 0].double()) >= OUTPUT_FLOOR_DB


@pytest.mark.parametrize("recipe", RECIPES, ids=str)
def test_decode_computes_what_the_grouped_gemm_computes_for_the_same_tokens(recipe):
    """A token's expert output is the same FP8 arithmetic whichever form runs it (the sums' order apart):
    the same casts, per row or per tensor, of the input and of each expert's weight."""
    x, weight, ids = _case()
    order = torch.argsort(ids, stable=True)
    offsets = torch.cumsum(torch.bincount(ids, minlength=weight.shape[0]), 0).to(torch.int32)
    with torch.no_grad():
        decoded = gathered_fp8_target(recipe, Lowering.EMULATED)(x[:, :, None], weight, ids,
                                                                 *_state_args(recipe, x, weight))[:, :, 0]
        grouped = grouped_fp8_target(recipe, Lowering.EMULATED, update=False)(x[order], weight, offsets,
                                                                              *_state_args(recipe, x, weight))
    torch.testing.assert_close(decoded[order], grouped, rtol=1e-5, atol=1e-5)


def test_the_decode_form_has_no_backward():
    x, weight, ids = _case()
    target = gathered_fp8_target(Float8RowwiseScaling(), Lowering.EMULATED)
    with pytest.raises(RuntimeError, match="no backward"):
        target(x[:, :, None].requires_grad_(), weight, ids)
