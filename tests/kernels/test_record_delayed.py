"""``fp8graph::record_delayed_``: a call's delayed-scaling state moved one step in one launch.

The op's torch reference is checked against the documented rule here; the Triton kernel against the
reference by Triton's interpreter (a fresh process, ``TRITON_INTERPRET=1``), and compiled for sm_90 and
sm_100 in ``tests/kernels/test_kernels_compile.py``. The state and resume tests (``tests/buffers/test_delayed_state.py``,
``test_checkpointing.py``) run every delayed site through it.
"""

import pytest
import torch

from fp8graph.kernels.delayed_record import record_delayed_
from fp8graph.kernels.quantize_tiles import triton_available
from helpers import cases_checked_under_triton_interpreter


def test_a_forward_call_records_each_members_amaxes_and_scales_by_the_documented_rule():
    # Two members (gate and up): rows 0 (input) and 1 (weight) move one step.
    histories = [torch.arange(8, dtype=torch.float32).reshape(2, 4) + 100 * i for i in range(2)]
    scales = [torch.full((2,), 7.0) for _ in range(2)]
    input_rows = torch.tensor([0.5, -3.0, 2.0]).abs()  # per-row partial magnitudes of the shared input
    partials = [input_rows, torch.tensor([4.0, 1.0]), input_rows, torch.tensor([0.25])]
    new_scales = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    record_delayed_(histories, scales, partials, new_scales, [])
    # history[0] = new amax, history[j] = history[j + 1] for 0 < j < len - 1, the old slot 0 moves to the end.
    assert histories[0].tolist() == [[3.0, 2.0, 3.0, 0.0], [4.0, 6.0, 7.0, 4.0]]
    assert histories[1].tolist() == [[3.0, 102.0, 103.0, 100.0], [0.25, 106.0, 107.0, 104.0]]
    assert scales[0].tolist() == [1.0, 2.0] and scales[1].tolist() == [3.0, 4.0]


def test_a_filling_call_keeps_the_weight_rows_scales():
    """An expert call's rows: the input, then one a expert; a fill keeps the scales the experts were cast with
    beside its weight copies (fp8graph.buffers.weight_cache), written by the same op."""
    histories, scales = [torch.zeros(3, 2)], [torch.ones(3)]
    kept_scales = [torch.zeros(2, 1)]
    partials = [torch.tensor([1.0, 9.0]), torch.tensor([0.5, -0.25]).abs(), torch.tensor([2.0])]
    record_delayed_(histories, scales, partials, torch.tensor([[4.0, 5.0, 6.0]]), kept_scales)
    assert histories[0][:, 0].tolist() == [9.0, 0.5, 2.0] and scales[0].tolist() == [4.0, 5.0, 6.0]
    assert kept_scales[0].tolist() == [[5.0], [6.0]]
    with pytest.raises(ValueError, match=r"none or one of 2 values a member each, got 1 of \[3\]"):
        record_delayed_(histories, scales, partials, torch.ones(1, 3), [torch.zeros(3)])


def test_a_backward_call_records_one_row_and_a_nan_amax_stays_visible():
    histories = [torch.zeros(1, 1), torch.zeros(1, 1)]
    scales = [torch.ones(1), torch.ones(1)]
    record_delayed_(histories, scales, [torch.tensor([1.0, float("nan")]), torch.tensor([float("inf")])],
                    torch.tensor([[5.0], [6.0]]), [])
    assert torch.isnan(histories[0][0, 0]) and histories[1][0, 0] == float("inf")
    assert scales[0].tolist() == [5.0] and scales[1].tolist() == [6.0]


def test_arguments_that_do_not_fit_are_refused():
    with pytest.raises(ValueError, match="2 histories, 1 scales and 2 amaxes for new_scales of shape"):
        record_delayed_([torch.zeros(1, 4)] * 2, [torch.ones(1)], [torch.ones(2)] * 2, torch.ones(2, 1), [])
    with pytest.raises(ValueError, match=r"2 rows recorded, but the histories and scales have"):
        record_delayed_([torch.zeros(3, 4)], [torch.ones(3)], [torch.ones(2)] * 2, torch.ones(1, 2), [])


@pytest.mark.skipif(not triton_available(), reason="Triton is not installed")
@pytest.mark.triton_interpreter
def test_the_triton_kernel_equals_the_reference_under_the_interpreter():
    assert cases_checked_under_triton_interpreter("check_record_delayed.py") == 120


def test_an_empty_partial_records_zero():
    """A weight whose kept cast a call reuses records nothing (fp8graph.buffers.weight_cache): its row gets an
    empty partial, and its history slot zero."""
    histories, scales = [torch.full((2, 3), 5.0)], [torch.ones(2)]
    record_delayed_(histories, scales, [torch.tensor([2.0, 7.0]), torch.empty(0)], torch.tensor([[3.0, 4.0]]), [])
    assert histories[0].tolist() == [[7.0, 5.0, 5.0], [0.0, 5.0, 5.0]]
