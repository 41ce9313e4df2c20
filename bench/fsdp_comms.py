"""``python -m bench fsdp-comms``: a Llama-3-8B step's FSDP2 communication, modelled: BF16 against FP8 all-gather.

Per recipe, the bytes each rank all-gathers and reduce-scatters in a step of a Llama-3-8B sharded per
decoder layer (``fully_shard`` each layer, then the root), the time they take on a link, and how much of
it the layers' compute hides. Nothing runs: the bytes are counted from the model's shapes; each layer's
compute is the cost model's step of ``bench model decoder`` (bench-8b-layer, the Llama-3-8B layer, 1 x 4096
tokens a GPU, fake H100), read from a committed modelled result.

    bytes       a decoder layer's weights are gathered before its forward and again before its backward
                (FSDP2's reshard_after_forward=True), the root's (embedding, final norm, lm_head) once; the
                gradients are reduce-scattered once, in BF16. FP8 all-gather (fp8graph.fsdp): each weight whose
                sites are FP8 moves 1 byte an element with per-tensor scaling, and the scales gathered with
                it: block scaling 4 bytes a 128x128 tile, row-wise 4 bytes a row; MXFP8 gathers both layouts,
                2 bytes an element and an E8M0 byte a block of 32 in each (no MXFP8 step is modelled: the
                decoder result is an H100's, which has no MXFP8 GEMM; its bytes are printed). The embedding
                and the norms stay BF16.
    link        a ring collective moves (N - 1) / N of the gathered size through each GPU's link: 8 H100s
                on NVLink at 450 GB/s a GPU, 2 x 8 over InfiniBand at 50 GB/s a GPU.
    hiding      FSDP2 gathers a layer while the previous one computes: a layer's forward hides its
                all-gather, its backward hides its all-gather and the reduce-scatter; what is left is exposed,
                and so are the root's gather (before any compute) and reduce-scatter (after the last).
                A layer's compute is the modelled 4-layer step (forward and backward graphs apart) less the
                lm_head GEMMs, over 4: its loss kernels stay in, so a layer is slightly overstated and the
                hiding slightly optimistic.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import re

from .costmodel import costs

__all__ = ["LINKS", "Llama3_8B", "add_arguments", "exposed_ms", "layer_compute_ms", "run", "step_bytes", "table",
           "weight_gather_bytes"]

DECODER_RESULT = pathlib.Path(__file__).resolve().parent / "results" / "model-decoder-2026-11-24T060511Z.json"
LINKS = {"8 H100, NVLink": (8, 450e9), "2 x 8 H100, InfiniBand": (16, 50e9)}
BF16_BYTES = 2
TILE, MX_BLOCK = 128, 32
# Rows each rank's shard must hold a multiple of to gather in FP8 (fp8graph.fsdp.install): whole tiles, and
# MXFP8's whole blocks along N.
SHARD_ROW_MULTIPLE = {"block": TILE, "mxfp8": MX_BLOCK}


def weight_gather_bytes(rows: int, columns: int, recipe: str, fp8_gather: bool, ranks: int) -> int:
    """Bytes of one (rows, columns) weight all-gathered over ``ranks``: BF16, or ``recipe``'s FP8 bytes and the
    scales gathered with them (per-tensor scales are not gathered: every rank computed them). A weight whose
    rows do not split into whole tiles per rank gathers in BF16, as fp8graph.fsdp.install decides."""
    elements = rows * columns
    whole_shards = rows % ranks == 0 and (rows // ranks) % SHARD_ROW_MULTIPLE.get(recipe, 1) == 0
    if not (fp8_gather and whole_shards):
        return BF16_BYTES * elements
    if recipe == "block":
        return elements + 4 * (rows // TILE) * (columns // TILE)
    if recipe == "rowwise":
        return elements + 4 * rows
    if recipe == "mxfp8":  # both layouts (blocks along K, and along N for grad_input)
        return 2 * elements + 2 * elements // MX_BLOCK
    return elements


@dataclasses.dataclass(frozen=True)
class Llama3_8B:
    hidden: int = 4096
    intermediate: int = 14336
    kv: int = 1024  # 8 key-value heads of 128
    layers: int = 32
    vocab: int = 128256

    def layer_weights(self) -> list[tuple[int, int]]:
        """(N, K) of a layer's projections: q, o; k, v; gate, up; down."""
        return ([(self.hidden, self.hidden)] * 2 + [(self.kv, self.hidden)] * 2
                + [(self.intermediate, self.hidden)] * 2 + [(self.hidden, self.intermediate)])

    def layer_linears(self) -> int:
        """Elements of a layer's projections."""
        return sum(rows * columns for rows, columns in self.layer_weights())

    def layer_norms(self) -> int:
        return 2 * self.hidden


def step_bytes(model: Llama3_8B, fp8_gather: bool, recipe: str = "current", ranks: int = 8) -> dict[str, float]:
    """Bytes per step a rank receives from all-gathers (the unsharded sizes) and reduce-scatters, per layer and
    for the root (embedding, final norm, lm_head), ``recipe``'s weights gathered in FP8 or in BF16."""
    layer_gathered = (sum(weight_gather_bytes(*shape, recipe, fp8_gather, ranks) for shape in model.layer_weights())
                      + model.layer_norms() * BF16_BYTES)
    root_gathered = (weight_gather_bytes(model.vocab, model.hidden, recipe, fp8_gather, ranks)  # lm_head
                     + model.vocab * model.hidden * BF16_BYTES + model.hidden * BF16_BYTES)  # embedding, norm
    layer_reduced = (model.layer_linears() + model.layer_norms()) * BF16_BYTES
    root_reduced = (2 * model.vocab * model.hidden + model.hidden) * BF16_BYTES
    return {"layer_all_gather": 2 * layer_gathered, "layer_reduce_scatter": layer_reduced,
            "root_all_gather": root_gathered, "root_reduce_scatter": root_reduced}


def layer_compute_ms(result: dict, contestant: str) -> tuple[float, float]:
    """(forward, backward) ms of one decoder layer: the modelled step's graphs less the lm_head GEMMs, over
    its layers (see the module's doc)."""
    capture = next(c for c in result["captures"] if c["contestant"] == contestant)
    (case,) = capture["cases"]
    rows = costs.rows_from_json(case)
    layers, vocab = re.match(r"(\d+) layers, vocab (\d+)", case["case"]).groups()  # "4 layers, vocab 32000, 1x4096"
    layers = int(layers)
    machine = costs.Machine()

    def graph_ms(kind: str) -> float:
        selected = [r for r in rows if r.graph.endswith(kind) and not (r.kind == "gemm" and vocab in r.detail)]
        return costs.summary(selected, machine)["step_ms"]

    return graph_ms("forward") / layers, graph_ms("backward") / layers


def exposed_ms(forward_ms: float, backward_ms: float, gather_ms: float, reduce_ms: float) -> float:
    """Per layer and step: the all-gather not hidden by the forward, plus the all-gather and reduce-scatter
    not hidden by the backward."""
    return max(0.0, gather_ms - forward_ms) + max(0.0, gather_ms + reduce_ms - backward_ms)


def table(result: dict, model: Llama3_8B = Llama3_8B()) -> list[dict]:
    """One row per link, recipe and gather: bytes, link time, exposed time, and the step (compute + exposed)
    against BF16's with BF16 gathers."""
    recipes = [("bf16", False), ("current", False), ("current", True), ("delayed", False), ("delayed", True),
               ("rowwise", False), ("rowwise", True), ("block", False), ("block", True)]
    rows = []
    for link, (ranks, bandwidth) in LINKS.items():
        baseline = None
        for contestant, fp8_gather in recipes:
            forward, backward = layer_compute_ms(result, contestant)
            sizes = step_bytes(model, fp8_gather, contestant, ranks)
            on_link = (ranks - 1) / ranks / bandwidth * 1e3  # ms a byte
            gather, reduce = sizes["layer_all_gather"] / 2 * on_link, sizes["layer_reduce_scatter"] * on_link
            # The root's gather comes before any compute and its reduce-scatter after the last: neither hidden.
            exposed = (model.layers * exposed_ms(forward, backward, gather, reduce)
                       + (sizes["root_all_gather"] + sizes["root_reduce_scatter"]) * on_link)
            compute = model.layers * (forward + backward)
            step = compute + exposed
            baseline = baseline or step
            rows.append({"link": link, "recipe": contestant, "gather": "FP8" if fp8_gather else "BF16",
                         "all_gather_gb": (model.layers * sizes["layer_all_gather"] + sizes["root_all_gather"]) / 1e9,
                         "reduce_scatter_gb": (model.layers * sizes["layer_reduce_scatter"]
                                               + sizes["root_reduce_scatter"]) / 1e9,
                         "layer_gather_ms": gather, "layer_reduce_ms": reduce, "layer_forward_ms": forward,
                         "layer_backward_ms": backward, "exposed_ms": exposed, "step_ms": step,
                         "vs_bf16": baseline / step})
    return rows


def markdown(rows: list[dict]) -> list[str]:
    columns = ["link", "recipe", "weights gathered in", "all-gather GB / step", "reduce-scatter GB / step",
               "a layer's all-gather ms", "a layer's forward / backward ms", "exposed ms / step",
               "layers' step ms", "vs BF16"]
    return costs.markdown(columns, [[r["link"], r["recipe"], r["gather"], f"{r['all_gather_gb']:.1f}",
                                     f"{r['reduce_scatter_gb']:.1f}", f"{r['layer_gather_ms']:.2f}",
                                     f"{r['layer_forward_ms']:.2f} / {r['layer_backward_ms']:.2f}",
                                     f"{r['exposed_ms']:.1f}", f"{r['step_ms']:.1f}", f"{r['vs_bf16']:.2f}x"]
                                    for r in rows])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--decoder-result", type=pathlib.Path, default=DECODER_RESULT,
                        help="a `bench model decoder` result: each layer's modelled compute")


def run(args: argparse.Namespace) -> None:
    result = json.loads(args.decoder_result.read_text())
    print(f"MODELLED (nothing ran): Llama-3-8B, 32 layers, 1 x 4096 tokens a GPU; compute from "
          f"{args.decoder_result.name}")
    print("\n".join(markdown(table(result))))
    model = Llama3_8B()
    for link, (ranks, _) in LINKS.items():
        gathered = {recipe: step_bytes(model, recipe != "bf16", recipe, ranks) for recipe in
                    ("bf16", "current", "rowwise", "block", "mxfp8")}
        print(f"All-gather GB a step on {link}, each recipe's weights gathered in FP8 (BF16 for bf16): " + ", ".join(
            f"{recipe} {(model.layers * b['layer_all_gather'] + b['root_all_gather']) / 1e9:.2f}"
            for recipe, b in gathered.items()))
