"""Token groups of the expert GEMMs: group ids, per-group column scales, padding of groups."""

import pytest
import torch

from fp8graph.numerics.groups import (group_column_amax, group_padding, padded_group_rows, padded_group_sources,
                                     place_in_padded_groups, quantize_group_columns, row_groups)
from fp8graph.numerics.quantize import quantize_current

# Expert 1 and 4 empty, rows 9 and 10 in no group (EP sentinels, as transformers leaves them).
OFFSETS = torch.tensor([3, 3, 7, 9, 9], dtype=torch.int32)
ROWS = 11


def test_row_groups_name_each_rows_expert_and_the_rows_in_none():
    assert row_groups(OFFSETS, ROWS).tolist() == [0, 0, 0, 2, 2, 2, 2, 3, 3, 5, 5]


def test_group_column_amax_is_each_groups_own_and_empty_groups_zero():
    torch.manual_seed(0)
    x = torch.randn(ROWS, 6, dtype=torch.bfloat16)
    x[4, 1] = float("nan")  # a non-finite value changes no amax (fp8graph.numerics.quantize.finite_magnitude)
    table = group_column_amax(x, OFFSETS)
    assert table.shape == (len(OFFSETS) + 1, 6) and table.dtype == torch.float32
    starts = [0, *OFFSETS.tolist()]
    for group, (start, end) in enumerate(zip(starts, OFFSETS.tolist())):
        rows = x[start:end].float().nan_to_num(0).abs()
        expected = rows.amax(0) if end > start else torch.zeros(6)
        assert torch.equal(table[group], expected), group
    assert torch.equal(table[-1], x[9:].float().abs().amax(0))


def test_quantize_group_columns_equals_a_per_tensor_cast_of_each_group_column():
    torch.manual_seed(1)
    x = torch.randn(ROWS, 4) * torch.logspace(-3, 3, 4)  # columns of very different magnitude
    x_fp8, scale = quantize_group_columns(x, OFFSETS, torch.float8_e4m3fn)
    assert scale.shape == (len(OFFSETS), 4)
    starts = [0, *OFFSETS.tolist()]
    for group, (start, end) in enumerate(zip(starts, OFFSETS.tolist())):
        for column in range(4 if end > start else 0):
            expected_fp8, expected_scale = quantize_current(x[start:end, column], torch.float8_e4m3fn)
            assert torch.equal(x_fp8[start:end, column].view(torch.uint8), expected_fp8.view(torch.uint8))
            assert scale[group, column] == expected_scale
    assert torch.all(scale[[1, 4]] == 1), "an empty group's scale is 1"


@pytest.mark.parametrize("offsets", [[3, 3, 7, 9, 9], [0, 0, 16, 16], [11], [1, 2, 3, 4, 5, 6, 7]])
def test_padded_group_rows_keep_each_group_in_order_at_a_multiple_of_16(offsets):
    offsets = torch.tensor(offsets, dtype=torch.int32)
    rows = ROWS if offsets[-1] <= ROWS else int(offsets[-1])
    destination, padded_offsets, padded_rows = padded_group_rows(offsets, rows, 16)
    assert padded_rows % 16 == 0 and rows + 16 * len(offsets) <= padded_rows < rows + 16 * (len(offsets) + 1)
    assert len(set(destination.tolist())) == rows and int(destination.max()) < padded_rows
    sizes = torch.diff(offsets, prepend=offsets.new_zeros(1))
    padded_sizes = torch.diff(padded_offsets, prepend=padded_offsets.new_zeros(1))
    assert torch.all(padded_sizes % 16 == 0) and torch.all(padded_sizes - sizes < 16) and torch.all(padded_sizes >= sizes)
    groups, padded_groups = row_groups(offsets, rows), row_groups(padded_offsets, padded_rows)
    assert torch.equal(padded_groups[destination], groups), "each row lands in its own group (or in none)"
    assert torch.all(destination[1:][groups[1:] == groups[:-1]] > destination[:-1][groups[1:] == groups[:-1]])


@pytest.mark.parametrize("offsets", [[3, 3, 7, 9, 9], [0, 0, 16, 16], [11], [1, 2, 3, 4, 5, 6, 7]])
def test_the_padding_is_every_row_of_a_padded_group_that_no_row_moves_to(offsets):
    offsets = torch.tensor(offsets, dtype=torch.int32)
    rows = ROWS if offsets[-1] <= ROWS else int(offsets[-1])
    destination, padded_offsets, padded_rows = padded_group_rows(offsets, rows, 16)
    pads = group_padding(offsets, padded_offsets, 16, padded_rows)
    assert pads.shape == (len(offsets) * 15,)
    in_groups = set(range(int(padded_offsets[-1])))
    moved = set(destination.tolist())
    assert set(pads.tolist()) - {padded_rows - 1} == in_groups - moved
    assert padded_rows - 1 not in moved | in_groups, "the unused slots write a row nothing reads"


@pytest.mark.parametrize("offsets", [[3, 3, 7, 9, 9], [0, 0, 16, 16], [11]])
def test_each_padded_row_names_the_row_it_holds_or_none(offsets):
    """padded_group_sources inverts padded_group_rows: every moved row's slot names it, every other slot -1."""
    offsets = torch.tensor(offsets, dtype=torch.int32)
    rows = max(ROWS, int(offsets[-1]))
    destination, padded_offsets, padded_rows = padded_group_rows(offsets, rows, 16)
    sources, got_offsets = padded_group_sources(offsets, rows, 16)
    assert torch.equal(got_offsets, padded_offsets) and sources.shape == (padded_rows,)
    assert torch.equal(sources[destination], torch.arange(rows))
    others = torch.ones(padded_rows, dtype=torch.bool).index_fill(0, destination, False)
    assert torch.all(sources[others] == -1)


def test_rows_placed_in_padded_groups_write_zeros_only_where_a_group_reads_them():
    """Into a buffer of NaNs: the groups read their rows and zeros, and nothing else is written."""
    torch.manual_seed(2)
    x = torch.randn(ROWS, 5).to(torch.bfloat16)
    destination, padded_offsets, padded_rows = padded_group_rows(OFFSETS, ROWS, 16)
    garbage = torch.full((padded_rows, 5), float("nan"), dtype=torch.bfloat16)
    padded, got_offsets = place_in_padded_groups(x, OFFSETS, 16, into=garbage)
    assert torch.equal(got_offsets, padded_offsets) and padded.dtype == x.dtype and padded.shape == garbage.shape
    assert torch.equal(padded.index_select(0, destination), x)
    in_groups = padded[:int(padded_offsets[-1])].float()
    rest = set(range(int(padded_offsets[-1]))) - set(destination.tolist())
    assert not torch.isnan(in_groups).any()
    assert torch.all(in_groups[sorted(rest)] == 0)
    untouched = sorted(set(range(padded_rows)) - set(range(int(padded_offsets[-1]))) - set(destination.tolist())
                       - {padded_rows - 1})
    assert untouched and torch.isnan(padded[untouched].float()).all(), \
        "past the groups, only the moved rows and the unused pads' row are written"


def _qwen3_mlp(tokens_an_expert: int, per_tensor: tuple[bool, bool] = (True, True)):
    """Qwen3-30B-A3B's expert MLP (128 experts, hidden 2048, width 768) as its two GEMMs, gate_up and down."""
    from fp8graph.numerics.groups import ExpertGemm

    rows = 128 * tokens_an_expert
    return [ExpertGemm(rows, 128, out_features=1536, in_features=2048, per_tensor=per_tensor[0]),
            ExpertGemm(rows, 128, out_features=2048, in_features=768, per_tensor=per_tensor[1])]


def test_an_expert_mlps_inputs_pay_for_its_weights_copies_together():
    """``weight_copies_kept``: a GEMM whose own input's saving over BF16 pays for its weight's copy keeps it
    (``weight_copy_fits``); what the MLP's inputs save beyond those pays for others, the largest first. At
    Qwen3-30B-A3B's proportions: 2048 tokens an expert, gate_up pays for its own and down's (which its own input
    does not: N = 2048 needs a little over 2064 tokens an expert); 1024, the two inputs pay for down's alone (gate_up's,
    the larger, does not fit: nor does a copy kept ahead of a larger one that would); 256, for neither. A GEMM that
    copies no weight (row-wise) still gives its input's saving, less its scales a group and column."""
    from fp8graph.numerics import groups
    from fp8graph.numerics.groups import weight_copies_kept, weight_copy_fits

    assert [weight_copy_fits(gemm, 16) for gemm in _qwen3_mlp(2048)] == [True, False]
    assert weight_copies_kept(_qwen3_mlp(2048), 16) == (True, True)
    assert weight_copies_kept(_qwen3_mlp(1024), 16) == (False, True)
    assert weight_copies_kept(_qwen3_mlp(256), 16) == (False, False)
    assert weight_copies_kept(_qwen3_mlp(1024, (True, False)), 16) == (False, False)
    assert weight_copies_kept(_qwen3_mlp(2048, (False, True)), 16) == (False, True)
    # The bytes: an input saves K (2 S - P) less its scales (fp32: 128 weight scales per tensor, 128 x K row-wise),
    # a copy and its inverse scales take 128 N (K + 4).
    rows = 128 * 2048
    padded = rows + 128 * 16
    gate_up, down = _qwen3_mlp(2048)
    assert groups._input_saving(gate_up, 16) == 2048 * (2 * rows - padded) - 4 * 128
    assert groups._input_saving(down._replace(per_tensor=False), 16) == 768 * (2 * rows - padded) - 4 * 128 * 768
    assert groups._copy_bytes(down) == 128 * 2048 * (768 + 4)
    # Down's own input pays for its copy from 2075 tokens an expert.
    assert [weight_copy_fits(_qwen3_mlp(tokens)[1], 16) for tokens in (2074, 2075)] == [False, True]


def test_a_symbolic_expert_mlp_pays_for_each_copy_by_its_own_input():
    """No guard is made on a symbolic token count: each GEMM keeps its copy only where its own input provably pays."""
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from fp8graph.numerics.groups import ExpertGemm, weight_copies_kept

    rows = ShapeEnv().create_unbacked_symint()
    mlp = [ExpertGemm(rows, 4, out_features=64, in_features=32), ExpertGemm(rows, 4, out_features=32, in_features=64)]
    assert weight_copies_kept(mlp, 16) == (False, False)
