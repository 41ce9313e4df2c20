"""The explain report as one self-contained HTML page, with each rewritten graph drawn in SVG.

Every FP8 site is drawn as its stages (quantize each operand, scaled GEMM,
dequantize to high precision) in its recipe's colour; sites kept in high
precision are outlined with their reason; other ops are plain boxes.
Parameters and buffers are not drawn (they would only widen the first row).
The layout is layered: a node sits one row below the lowest of its inputs.
No external files, scripts or fonts are referenced.
"""

from __future__ import annotations

import html
import itertools

import torch.fx

from fp8graph.passes.annotate import DECISION_KEY

__all__ = ["graph_outline", "render_html"]

_PALETTE = ("#1b9e77", "#d95f02", "#7570b3", "#e7298a", "#66a61e", "#e6ab02")
_ROW_HEIGHT, _BOX_HEIGHT, _GAP = 80, 46, 24
_OP_WIDTH, _STAGE_WIDTH = 190, 118


def _is_state(node: torch.fx.Node) -> bool:
    # Dynamo names lifted parameters and buffers ..._parameters_<name>_ / ..._buffers_<name>_.
    return node.op == "get_attr" or (
        node.op == "placeholder" and ("_parameters_" in node.name or "_buffers_" in node.name))


def graph_outline(gm: torch.fx.GraphModule) -> list[dict]:
    """The drawable nodes of a rewritten graph: name, kind, label, inputs, recipe or reason."""
    drawn = [n for n in gm.graph.nodes if not _is_state(n)]
    names = {n.name for n in drawn}
    outline = []
    for node in drawn:
        decision = node.meta.get(DECISION_KEY)
        entry = {"name": node.name, "kind": "op", "label": node.name, "detail": "",
                 "inputs": [i.name for i in node.all_input_nodes if i.name in names]}
        if node.op in ("placeholder", "output"):
            entry["kind"] = "io"
        elif decision is not None and decision.rewritten:
            entry.update(kind="fp8_site", label=decision.site.path or "<root>",
                         recipe=decision.recipe.name, lowering=decision.lowering.value,
                         is_linear=decision.site.is_linear, op=decision.site.op)
        elif decision is not None:
            entry.update(kind="kept_site", label=f"{decision.site.op}: {decision.site.path or '<root>'}",
                         detail=decision.reason)
        else:
            target = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))
            entry["label"] = f"{target}"
        outline.append(entry)
    return outline


def _layout(outline: list[dict]) -> dict[str, tuple[int, int, int]]:
    """``{name: (x, y, width)}``: rows by longest path from the inputs, left to right in graph order."""
    row_of: dict[str, int] = {}
    for entry in outline:
        row_of[entry["name"]] = 1 + max((row_of[i] for i in entry["inputs"]), default=-1)
    positions, next_x = {}, {}
    for entry in outline:
        row = row_of[entry["name"]]
        width = 4 * _STAGE_WIDTH if entry["kind"] == "fp8_site" else _OP_WIDTH
        x = next_x.get(row, _GAP)
        positions[entry["name"]] = (x, _GAP + row * _ROW_HEIGHT, width)
        next_x[row] = x + width + _GAP
    return positions


def _text(x, y, text, css_class="label"):
    return f'<text class="{css_class}" x="{x}" y="{y}">{html.escape(str(text))}</text>'


def _fp8_site_svg(entry: dict, x: int, y: int, colour: str) -> str:
    """A site as a framed group: its path and recipe on top, its four stages below."""
    operands = ("input", "weight") if entry["is_linear"] else ("a", "b")
    stages = [("quantize", f"quantize {operands[0]}"), ("quantize", f"quantize {operands[1]}"),
              ("scaled-gemm", "scaled GEMM"), ("dequantize", "dequantize")]
    title = f"{entry['label']}: {entry['recipe']}, {entry['lowering']}"
    parts = [f'<g class="graph-node fp8-site" data-recipe="{html.escape(entry["recipe"])}">',
             f"<title>{html.escape(title)}</title>",
             f'<rect class="frame" x="{x}" y="{y}" width="{4 * _STAGE_WIDTH}" height="{_BOX_HEIGHT}" '
             f'rx="5" stroke="{colour}" />',
             _text(x + 6, y + 15, f"{entry['label']} · {entry['recipe']} · {entry['lowering']}")]
    for index, (css_class, label) in enumerate(stages):
        stage_x = x + 3 + index * _STAGE_WIDTH
        parts.append(f'<rect class="stage {css_class}" x="{stage_x}" y="{y + 21}" width="{_STAGE_WIDTH - 6}" '
                     f'height="{_BOX_HEIGHT - 24}" rx="4" fill="{colour}" />')
        parts.append(_text(stage_x + 5, y + 35, label, "stage-label"))
    parts.append("</g>")
    return "".join(parts)


def _graph_svg(outline: list[dict], colours: dict[str, str]) -> str:
    positions = _layout(outline)
    width = max((x + w for x, _, w in positions.values()), default=0) + _GAP
    height = max((y for _, y, _ in positions.values()), default=0) + _ROW_HEIGHT
    edges, boxes = [], []
    for entry in outline:
        x, y, w = positions[entry["name"]]
        for source in entry["inputs"]:
            sx, sy, sw = positions[source]
            x0, y0, x1 = sx + sw / 2, sy + _BOX_HEIGHT, x + w / 2
            edges.append(f'<path class="edge" d="M{x0},{y0} C{x0},{y0 + 30} {x1},{y - 30} {x1},{y}" />')
        if entry["kind"] == "fp8_site":
            boxes.append(_fp8_site_svg(entry, x, y, colours[entry["recipe"]]))
            continue
        title = entry["label"] + (f": {entry['detail']}" if entry["detail"] else "")
        boxes.append(f'<g class="graph-node {entry["kind"].replace("_", "-")}"><title>{html.escape(title)}</title>'
                     f'<rect x="{x}" y="{y}" width="{w}" height="{_BOX_HEIGHT}" rx="5" />'
                     + _text(x + 6, y + 18, entry["label"][:30])
                     + (_text(x + 6, y + 35, entry["detail"][:32], "detail") if entry["detail"] else "")
                     + "</g>")
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}">{"".join(edges)}{"".join(boxes)}</svg>')


_STYLE = """
body { font-family: sans-serif; margin: 1.5em; color: #222; }
table { border-collapse: collapse; font-size: 13px; }
td, th { border: 1px solid #ccc; padding: 3px 8px; text-align: left; }
.kept { color: #8a6d00; }
svg text { font-size: 11px; font-family: monospace; }
.edge { fill: none; stroke: #999; stroke-width: 1; }
.graph-node.op rect, .graph-node.io rect { fill: #f4f4f4; stroke: #888; }
.graph-node.kept-site rect { fill: #fff8e1; stroke: #c99a00; stroke-width: 2; stroke-dasharray: 4 2; }
.fp8-site .frame { fill: #fff; stroke-width: 2; }
.fp8-site .stage-label { fill: #fff; }
.legend span { display: inline-block; padding: 2px 10px; margin-right: 8px; color: #fff; border-radius: 4px; }
details { margin: 1em 0; }
"""

_RENDER_CHECK = """
<script>
// Record how many drawn nodes have a laid-out box, so a headless browser can check the drawing.
window.addEventListener("load", () => {
  const laidOut = (sel) => [...document.querySelectorAll(sel)]
    .filter((e) => { const b = e.getBBox(); return b.width > 0 && b.height > 0; }).length;
  document.body.dataset.renderedNodes = laidOut(".graph-node");
  document.body.dataset.renderedFp8Sites = laidOut(".fp8-site");
});
</script>
"""


def render_html(report) -> str:
    """The whole page for an :class:`fp8graph.ExplainReport`."""
    recipes = sorted({str(r.recipe) for r in report.rewritten})
    colours = dict(zip(recipes, itertools.cycle(_PALETTE)))
    rows = "".join(
        "<tr>" + "".join(f"<td>{html.escape(str(v))}</td>" for v in (
            r.path or "<root>", r.op, r.M, r.K, r.N, str(r.dtype).removeprefix("torch."))) +
        (f'<td style="color:{colours[str(r.recipe)]}">{html.escape(str(r.recipe))}</td>' if r.rewritten
         else f'<td class="kept">{html.escape(str(r.reason))}</td>') +
        f"<td>{html.escape(str(r.lowering or '-'))}</td><td>{html.escape(r.rule)}</td></tr>"
        for r in report)
    legend = "".join(f'<span style="background:{colour}">{html.escape(recipe)}</span>'
                     for recipe, colour in colours.items())
    graphs = "".join(
        f"<h2>Graph {index} (rewritten)</h2>{_graph_svg(outline, colours)}"
        f"<details><summary>code of graph {index}</summary><pre>{html.escape(code)}</pre></details>"
        for index, (outline, code) in enumerate(zip(report.graph_outlines, report.graph_code)))
    summary = "".join(f"<li>{html.escape(line)}</li>" for line in report.summary_lines())
    unmatched = "".join(f"<li>policy rule matched no site: {html.escape(r)}</li>" for r in report.unmatched_rules)
    return (
        "<!DOCTYPE html><html><head><meta charset='utf-8'><title>fp8graph report</title>"
        f"<style>{_STYLE}</style></head><body>"
        f"<h1>fp8graph: {len(report.rewritten)} of {len(report)} sites in FP8</h1>"
        f"<ul>{summary}{unmatched}</ul><p class='legend'>{legend}</p>"
        "<table><tr><th>module path</th><th>op</th><th>M</th><th>K</th><th>N</th><th>input dtype</th>"
        f"<th>FP8 recipe / reason kept</th><th>lowering</th><th>decided by</th></tr>{rows}</table>"
        f"{graphs}{_RENDER_CHECK}</body></html>"
    )
