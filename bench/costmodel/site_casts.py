"""fp8graph.costs.casts's table, derived from the kernels a linear step's capture holds.

Every kernel that is not a GEMM is counted against the operand of its largest tensor argument's size (at
16384x4096x14336 the three operands differ in size); kernels that move under 0.1 MB, or work on no operand
(the second pass of a split amax, over partial maxima), count as small launches.
``python -m bench model linear --casts`` prints the table as fp8graph/costs/casts.py holds it.
"""

from __future__ import annotations

from bench.costmodel.costs import TINY_BYTES

SHAPE = (16384, 4096, 14336)  # M, K, N: input, weight and grad_output of three different sizes


def _operand(row: dict, sizes: dict[str, int]) -> str | None:
    """The operand the row's kernel works on: the one of its largest argument's size, if any."""
    return next((operand for operand, size in sizes.items() if row["largest_numel"] == size), None)


def derive(rows: list[dict], M: int, K: int, N: int) -> dict:
    """``{"kernels": [(operand, backward, custom_op, launches, read, written)], "small_launches": n,
    "small_backward_launches": n}``: bytes per element of the operand, rounded to 1/64 byte."""
    sizes = {"input": M * K, "weight": N * K, "grad_output": M * N}
    groups: dict[tuple, list] = {}
    small = small_backward = 0
    for row in rows:
        if row["kind"] in ("gemm", "attention", "optimizer"):
            continue
        backward = row["graph"].endswith("backward")
        operand = _operand(row, sizes)
        if operand is None or row["read"] + row["written"] < TINY_BYTES:
            small += row["count"]
            small_backward += row["count"] if backward else 0
            continue
        key = (operand, backward, row["kind"] == "extern")
        totals = groups.setdefault(key, [0, 0, 0])
        totals[0] += row["count"]
        totals[1] += row["read"] * row["count"]
        totals[2] += row["written"] * row["count"]
    order = {operand: i for i, operand in enumerate(sizes)}
    kernels = [(operand, backward, custom_op, launches, round(read / sizes[operand] * 64) / 64,
                round(written / sizes[operand] * 64) / 64)
               for (operand, backward, custom_op), (launches, read, written)
               in sorted(groups.items(), key=lambda item: (order[item[0][0]], item[0][1], item[0][2]))]
    return {"kernels": kernels, "small_launches": small, "small_backward_launches": small_backward}


def as_recipe_casts(derived: dict):
    """:func:`derive`'s answer as fp8graph.costs.casts holds it, to compare with the table."""
    from fp8graph.costs.casts import CastKernels, RecipeCasts

    return RecipeCasts(tuple(CastKernels(*kernel) for kernel in derived["kernels"]), derived["small_launches"],
                       derived["small_backward_launches"])


def table_source(derived: dict[str, dict]) -> str:
    """``CAST_TRAFFIC``'s Python source for each recipe kind's derived casts."""
    lines = ["CAST_TRAFFIC: dict[str, RecipeCasts] = {"]
    for kind, casts in derived.items():
        lines.append(f'    "{kind}": RecipeCasts((')
        lines += [f'        _k("{o}", {b}, {c}, {n}, {r!r}, {w!r}),' for o, b, c, n, r, w in casts["kernels"]]
        lines.append(f'    ), small_launches={casts["small_launches"]}, '
                     f'small_backward_launches={casts["small_backward_launches"]}),')
    lines.append("}")
    return "\n".join(lines)
