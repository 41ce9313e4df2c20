"""fp8graph.costs.casts's table, derived from the kernels a linear step's capture holds.

Every kernel that is not a GEMM is counted against the operand of its largest tensor argument's size (at
16384x4096x14336 the three operands differ in size); kernels that move under 0.1 MB, or work on no operand
(the second pass of a split amax, over partial maxima), count as small launches.
``python -m bench model linear --casts`` prints the table as fp8graph/costs/casts.py holds it.
"""

from __future__ import annotations

from bench.costmodel.costs import OUTSIDE_GEMM_KINDS, TINY_BYTES, Row, fp8_cast

SHAPE = (16384, 4096, 14336)  # M, K, N: input, weight and grad_output of three different sizes


def linear_spec(contestant: str) -> dict:
    """The capture the table is derived from: ``contestant``'s bench linear step at :data:`SHAPE`."""
    return {"workload": "linear", "shapes": [list(SHAPE)], "bias": False, "cubin": False, "contestant": contestant}


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


# --- expert sites: what a recipe adds to a MoE block, per routed-token element and per weight element -------

# The three Qwen3-30B-A3B blocks of the sweep the grouped table is solved from (the same weights, 4x and 8x the
# tokens): at 256 tokens an expert every expert site casts its weight again in the backward; at 1024 the down
# projection keeps its weight's copy from the forward on what the two GEMMs' inputs save (gate_up's would not fit
# beside it); at 2048 both keep theirs (fp8graph.numerics.groups.weight_copies_kept). Three blocks, three unknowns a
# kind of kernel: bytes per routed-token element, per weight element and per element of a weight kept.
GROUPED_CASES = ("Qwen3-30B-A3B, 1x4096, 256 tokens an expert, 1 micro-batch",
                 "Qwen3-30B-A3B, 4x4096, 1024 tokens an expert, 1 micro-batch",
                 "Qwen3-30B-A3B, 8x4096, 2048 tokens an expert, 1 micro-batch")
# The recipes whose rows the sweep holds (bench moe's), each against BF16's; the per-tensor ones keep the copy.
GROUPED_RECIPES = ("current", "delayed", "rowwise")
KEEPS_WEIGHT_COPY = ("current", "delayed")


# The kinds of kernel the grouped table keeps apart, each run at its own rate (fp8graph.costs.casts.KernelBytes).
KERNEL_KINDS = ("cast", "plain", "custom_op")


def _kernel_kind(row: dict) -> str:
    if row["kind"] != "triton":
        return "custom_op"
    return "cast" if fp8_cast(Row(**row)) else "plain"


def _extra(rows: list[dict], baseline: list[dict]) -> dict[str, float]:
    """What ``rows`` move and launch beyond ``baseline``'s, outside the GEMMs and the optimizer: bytes of
    Inductor's FP8 casts, of its other kernels and of custom ops, and launches."""
    def totals(selection):
        moved = dict.fromkeys((*KERNEL_KINDS, "launches"), 0)
        for row in selection:
            if row["kind"] not in OUTSIDE_GEMM_KINDS:
                continue
            moved[_kernel_kind(row)] += (row["read"] + row["written"]) * row["count"]
            moved["launches"] += row["count"]
        return moved

    mine, theirs = totals(rows), totals(baseline)
    return {key: mine[key] - theirs[key] for key in mine}


def block_sites(shape: dict) -> list[tuple[int, int, int, int]]:
    """A sweep block's two expert GEMMs as ``(routed rows S, K, N, experts)``: gate_up (K = hidden, N = 2 x
    width) and down (K = width, N = hidden)."""
    from fp8graph.models.moe import CONFIGS

    fields = {**CONFIGS[shape["config"]], **shape["overrides"]}
    hidden, width, experts = fields["hidden"], fields["expert_width"], fields["experts"]
    rows = shape["batch"] * shape["sequence"] * fields["top_k"]
    return [(rows, hidden, 2 * width, experts), (rows, width, hidden, experts)]


def _expert_gemms(shape: dict) -> list:
    """:func:`block_sites` as the weight-copy rule weighs them (``fp8graph.numerics.groups.ExpertGemm``)."""
    from fp8graph.numerics.groups import ExpertGemm

    return [ExpertGemm(rows, experts, out_features=n, in_features=k) for rows, k, n, experts in block_sites(shape)]


def site_elements(shape: dict) -> list[tuple[int, int, int]]:
    """Each of a sweep block's two expert GEMMs' ``(routed-token elements M x (K + N), expert-weight elements E x
    K x N, kept)``, ``kept`` its weight elements where the site keeps its weight's copy for grad_input from the
    forward (``fp8graph.numerics.groups.weight_copies_kept`` over the block's expert MLP, the rule the per-tensor
    recipes' sites follow), else 0."""
    from fp8graph.numerics.groups import weight_copies_kept
    from fp8graph.recipes.scaling import FP8_GEMM_DIM_MULTIPLE

    kept = weight_copies_kept(_expert_gemms(shape), FP8_GEMM_DIM_MULTIPLE)
    return [(rows * (k + n), experts * k * n, experts * k * n if keeps else 0)
            for (rows, k, n, experts), keeps in zip(block_sites(shape), kept)]


def block_elements(shape: dict) -> tuple[int, int, int]:
    """A sweep block's (routed-token elements, expert-weight elements, elements of weights kept) over its two
    expert GEMMs (:func:`site_elements`)."""
    return tuple(map(sum, zip(*site_elements(shape))))


def _per_64th(value: float) -> float:
    return round(value * 64) / 64


def _sweep(result: dict) -> tuple[dict, dict]:
    """A sweep result's shapes by their one-micro-batch case, and each contestant's rows by case."""
    shapes = {f"{shape['label']}, 1 micro-batch": shape for shape in result["spec"]["shapes"]}
    captures = {capture["contestant"]: {case["case"]: case["rows"] for case in capture["cases"]}
                for capture in result["captures"]}
    return shapes, captures


def _rates(extras: list[dict], elements: list[tuple[int, int, int]], keeps: bool) -> dict:
    """Bytes per routed-token element, per weight element and (where the recipe ``keeps`` weight copies) per
    element of a weight whose copy is kept, of each kind of kernel, and launches, from what the blocks add
    (``extras``) over their ``(tokens, weights, kept)`` elements: one equation a block, an unknown a column (the
    first two blocks and two columns for a recipe that keeps no copy)."""
    import torch

    unknowns = 3 if keeps else 2
    system = torch.tensor([row[:unknowns] for row in elements[:unknowns]], dtype=torch.float64)
    # Each column scaled to its largest entry: a condition number that says whether the blocks tell the rates
    # apart, whatever the elements' magnitudes.
    if torch.linalg.cond(system / system.abs().amax(dim=0)) > 1e3:
        raise ValueError(f"the blocks {elements[:unknowns]} do not tell the {unknowns} rates apart")
    columns = {"activation": {}, "weight": {}, "kept_weight": {}}
    for kind in KERNEL_KINDS:
        extra = torch.tensor([extra[kind] for extra in extras[:unknowns]], dtype=torch.float64)
        solved = torch.linalg.solve(system, extra).tolist()
        for name, value in zip(columns, [*solved, 0.0][:3]):
            columns[name][kind] = _per_64th(value)
    return {"activation": tuple(columns["activation"].values()), "weight": tuple(columns["weight"].values()),
            "launches": extras[0]["launches"], "kept_weight": tuple(columns["kept_weight"].values())}


def derive_grouped(result: dict) -> dict[str, dict]:
    """Per recipe of a ``bench model moe --sweep`` result: bytes per routed-token element and per weight
    element (Inductor's kernels and custom ops apart) and launches a block adds over BF16's, and for the recipes
    whose sites keep their weight's copy from the forward the change per weight element of a site that keeps it,
    solved from :data:`GROUPED_CASES` (:func:`_rates`)."""
    shapes, captures = _sweep(result)
    elements = [block_elements(shapes[case]) for case in GROUPED_CASES]
    derived = {}
    for contestant in GROUPED_RECIPES:
        extras = [_extra(captures[contestant][case], captures["bf16"][case]) for case in GROUPED_CASES]
        derived[contestant] = _rates(extras, elements, contestant in KEEPS_WEIGHT_COPY)
    return derived


def derive_stages(result: dict) -> dict[str, tuple[dict, dict]]:
    """Per recipe of a ``bench model moe --sweep`` result, :func:`derive_grouped`'s rates for each of the expert
    MLP's two GEMMs apart: stage 0 (gate_up) from what ``<recipe> gate_up only`` (``bench.moe.FIRST_GEMM_ONLY``)
    adds to BF16's block, stage 1 (the down projection) from what ``<recipe>`` adds beyond that, each per element
    of its own GEMM (:func:`site_elements`), solved from :data:`GROUPED_CASES`. The difference is down's alone
    only where ``gate_up only`` keeps gate_up's copy where the whole MLP does, which is checked: there gate_up's
    own input pays for it."""
    from fp8graph.numerics.groups import weight_copy_fits
    from fp8graph.recipes.scaling import FP8_GEMM_DIM_MULTIPLE

    shapes, captures = _sweep(result)
    for case in GROUPED_CASES:
        alone = weight_copy_fits(_expert_gemms(shapes[case])[0], FP8_GEMM_DIM_MULTIPLE)
        if alone != bool(site_elements(shapes[case])[0][2]):
            raise ValueError(f"{case}: gate_up keeps its copy with the down projection in FP8 and not alone (or the "
                             "other way round): the steps with gate_up alone do not isolate the down projection")
    derived = {}
    for contestant in GROUPED_RECIPES:
        def extra(case: str, stage: int) -> dict[str, float]:
            first = _extra(captures[f"{contestant} gate_up only"][case], captures["bf16"][case])
            if stage == 0:
                return first
            both = _extra(captures[contestant][case], captures["bf16"][case])
            return {key: both[key] - first[key] for key in both}

        derived[contestant] = tuple(
            _rates([extra(case, stage) for case in GROUPED_CASES],
                   [site_elements(shapes[case])[stage] for case in GROUPED_CASES], contestant in KEEPS_WEIGHT_COPY)
            for stage in (0, 1))
    return derived


def grouped_casts(derived: dict) -> "GroupedCasts":
    """:func:`derive_grouped`'s answer for one recipe as the table's entry."""
    from fp8graph.costs.casts import GroupedCasts, KernelBytes

    return GroupedCasts(KernelBytes(*derived["activation"]), KernelBytes(*derived["weight"]), derived["launches"],
                        KernelBytes(*derived["kept_weight"]))


def stage_casts(derived: dict) -> "GroupedCasts":
    """:func:`derive_stages`' answer for one recipe and stage as the stage table's entry."""
    from dataclasses import replace

    return replace(grouped_casts(derived), sites=1)


def stage_table_source(derived: dict[str, tuple[dict, dict]]) -> str:
    """``GROUPED_STAGE_CAST_TRAFFIC``'s Python source for :func:`derive_stages`' answer."""
    def kernel_bytes(values):
        return f"_b({', '.join(map(repr, values))})"

    lines = ["GROUPED_STAGE_CAST_TRAFFIC: dict[str, tuple[GroupedCasts, GroupedCasts]] = {"]
    for kind, stages in derived.items():
        opening = f'    "{kind}": ('
        for index, c in enumerate(stages):
            indent = opening if index == 0 else " " * len(opening)
            lines.append(f'{indent}GroupedCasts({kernel_bytes(c["activation"])}, {kernel_bytes(c["weight"])}, '
                         f'{c["launches"]},')
            lines.append(f'{" " * (len(indent) + len("GroupedCasts("))}{kernel_bytes(c["kept_weight"])}, sites=1)'
                         + ("," if index == 0 else "),"))
    return "\n".join(lines + ["}"])


def grouped_table_source(derived: dict[str, dict]) -> str:
    """``GROUPED_CAST_TRAFFIC``'s Python source for :func:`derive_grouped`'s answer."""
    def kernel_bytes(values):
        return f"_b({', '.join(map(repr, values))})"

    lines = ["GROUPED_CAST_TRAFFIC: dict[str, GroupedCasts] = {"]
    for kind, c in derived.items():
        opening = f'    "{kind}": GroupedCasts('
        lines.append(f'{opening}{kernel_bytes(c["activation"])}, {kernel_bytes(c["weight"])}, {c["launches"]},')
        lines.append(f'{" " * len(opening)}{kernel_bytes(c["kept_weight"])}),')
    return "\n".join(lines + ["}"])
