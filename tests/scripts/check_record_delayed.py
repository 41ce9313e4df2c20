"""Run by tests/kernels/test_record_delayed.py under TRITON_INTERPRET=1: the delayed-state kernel against the op's
torch reference, exactly: history lengths 1, 2, 5 and 1024 (one block, and a partial second block at
1500), one to five members, forward (two rows) and backward (one row) calls, partial amaxes longer than a
block (the block grows with the longest row, to 16384: rows of 40000 take three), in BF16 and fp32, with a NaN and an inf among them, and empty partials (zero recorded); forward calls also with kept buffers (a filling
call's weight copies: the weight rows' scales), and an expert call's three rows (input, two
experts) with them; and expert calls whose experts' rows are one tensor's rows (the rows kernel), with and
without kept buffers, empty rows among them."""

import torch

from fp8graph.kernels.delayed_record import _record_reference, plan_record_delayed

generator = torch.Generator().manual_seed(0)
cases = 0
for history_len in (1, 2, 5, 1024, 1500):
    for members in (1, 3, 5):
        shapes = [(2, False), (2, True), (1, False)] + ([(3, True)] if history_len == 5 else [])
        for rows, keep in shapes:
            for dtype in (torch.bfloat16, torch.float32):
                histories = [torch.rand(rows, history_len, generator=generator) for _ in range(members)]
                scales = [torch.rand(rows, generator=generator) + 1 for _ in range(members)]
                # Longer than a block: 2500 (a block of 4096 is the whole row), 40000 (16384 a block: two and a
                # part, the longest row setting the block of every row).
                lengths = [1, 7, 1024, 40000 if (history_len, members) == (5, 3) else 2500]
                partials = [torch.rand(lengths[(i + r) % 4], generator=generator).to(dtype) * 100
                            for i in range(members) for r in range(rows)]
                if members > 1:
                    partials[1][0] = float("nan")
                    partials[-1][-1] = float("inf")
                if keep:  # a reused weight's row records nothing: an empty partial
                    partials[rows - 1] = partials[rows - 1][:0]
                new_scales = torch.rand(members, rows, generator=generator)
                kept = [torch.zeros(rows - 1, 1) for _ in range(members)] if keep else []
                expected_h, expected_s = [h.clone() for h in histories], [s.clone() for s in scales]
                expected_kept = [k.clone() for k in kept]
                _record_reference(expected_h, expected_s, partials, new_scales, expected_kept)
                plan_record_delayed(histories, scales, partials, new_scales, kept)()
                for got, expected in zip(histories + scales + kept, expected_h + expected_s + expected_kept):
                    # Exact; a NaN amax is NaN in both (its payload is not compared).
                    torch.testing.assert_close(got, expected, rtol=0, atol=0, equal_nan=True,
                                               msg=lambda m: f"{(history_len, members, rows, keep, dtype)}: {m}")
                cases += 1
# An expert call: the input's row, then each expert's row of one (E, N) tensor of partial amaxes (the rows kernel);
# a reusing call's experts record nothing (an (E, 0) tensor).
for history_len in (5, 1024):
    for keep in (False, True):
        for dtype in (torch.bfloat16, torch.float32):
            for row_length in (7, 1030, 0):
                rows = 9
                histories = [torch.rand(rows, history_len, generator=generator)]
                scales = [torch.rand(rows, generator=generator) + 1]
                weight_amaxes = torch.rand(rows - 1, row_length, generator=generator).to(dtype) * 100
                # the gathered tokens' magnitudes: many blocks
                input_length = 40000 if (row_length, history_len) == (7, 5) else 300
                partials = [torch.rand(input_length, generator=generator).to(dtype), *weight_amaxes.unbind(0)]
                new_scales = torch.rand(1, rows, generator=generator)
                kept = [torch.zeros(rows - 1, 1)] if keep else []
                expected_h, expected_s = [h.clone() for h in histories], [s.clone() for s in scales]
                expected_kept = [k.clone() for k in kept]
                _record_reference(expected_h, expected_s, partials, new_scales, expected_kept)
                launch = plan_record_delayed(histories, scales, partials, new_scales, kept)
                assert launch.kernel.__name__ == "record_delayed_rows_kernel", launch.kernel
                launch()
                for got, expected in zip(histories + scales + kept, expected_h + expected_s + expected_kept):
                    torch.testing.assert_close(got, expected, rtol=0, atol=0,
                                               msg=lambda m: f"{(history_len, keep, dtype, row_length)}: {m}")
                cases += 1
print(f"cases checked: {cases}")
