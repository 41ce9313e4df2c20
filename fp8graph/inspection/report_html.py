"""The explain report as one self-contained HTML page, with each rewritten graph drawn in SVG.

Each graph is drawn as a sequence of module groups in graph order (see
:mod:`fp8graph.inspection.report_layout`): one per repeated block (``model.layers.3``)
and one per run of nodes between blocks (embeddings before the first layer,
norm and head after the last). Each group is a collapsible ``<details>``
whose summary gives its module path, op count, FP8 sites per recipe and
kept sites, holding an SVG of its own nodes laid out top to bottom by
grandalf's layered (Sugiyama) layout. Edges to or from another group end at
small port boxes naming that group, links to it, so no edge crosses the page.
Groups outside blocks and each graph's first block start open; the other
blocks, which repeat the first, start collapsed, so a 32-layer model's page
opens on one layer (buttons open or close them all).

Every FP8 site is drawn in its recipe's colour as its stages (quantize each
operand, scaled GEMM, dequantize to high precision); sites kept in high
precision are outlined with their reason; other ops are plain boxes sized to
their label. Parameters and buffers are not drawn (they would only widen the
first rank). No external files, scripts or fonts are referenced.
"""

from __future__ import annotations

import collections
import html
import itertools

import torch.fx

from fp8graph.passes.annotate import DECISION_KEY
from fp8graph.passes.module_paths import module_path

from fp8graph.inspection.report_layout import Group, GroupLayout, Port, group_outline, layout_group

__all__ = ["graph_outline", "render_html"]

_PALETTE = ("#1b9e77", "#d95f02", "#7570b3", "#e7298a", "#66a61e", "#e6ab02")
# Widths of one character of the page's monospace fonts (DejaVu Sans Mono is 0.6 em), with a
# margin, so boxes are sized to hold their text.
_CHAR_WIDTH, _SMALL_CHAR_WIDTH = 6.8, 6.2
_MAX_LABEL = 44  # characters; longer labels are cut with "…" (the box's tooltip has them whole)
_PAD = 8  # text inset in a box
_OP_HEIGHT, _KEPT_HEIGHT, _PORT_HEIGHT = 24, 38, 20
_CHIP_WIDTH, _CHIP_HEIGHT = 104, 16  # an FP8 site's stage boxes, two by two
_SITE_HEIGHT = 36 + 2 * _CHIP_HEIGHT + 8


def _is_state(node: torch.fx.Node) -> bool:
    # Dynamo names lifted parameters and buffers ..._parameters_<name>_ / ..._buffers_<name>_.
    return node.op == "get_attr" or (
        node.op == "placeholder" and ("_parameters_" in node.name or "_buffers_" in node.name))


def graph_outline(gm: torch.fx.GraphModule, paths_by_id: dict[str, str] | None = None) -> list[dict]:
    """The drawable nodes of a rewritten graph: name, kind, label, module, inputs, recipe or reason.

    ``paths_by_id`` (``module_paths_by_id(model)``) names each node's module as
    ``named_modules()`` does; without it the path is read from Dynamo's source,
    which for a module reached through a hook's closure is that closure's access
    path (``embed_tokens._forward_hooks[...].__closure__.0``), not a module path.
    """
    drawn = [n for n in gm.graph.nodes if not _is_state(n)]
    names = {n.name for n in drawn}
    outline = []
    for node in drawn:
        decision = node.meta.get(DECISION_KEY)
        # The node's own module path, not the decision's: in a regional block's graph the
        # decision names the first instance while every node's path is relative to the block.
        entry = {"name": node.name, "kind": "op", "label": node.name, "detail": "", "module": module_path(node, paths_by_id),
                 "inputs": [i.name for i in node.all_input_nodes if i.name in names]}
        if node.op in ("placeholder", "output"):
            entry["kind"] = "io"
        elif decision is not None and decision.rewritten:
            entry.update(kind="fp8_site", label=decision.site.path or "<root>",
                         recipe=decision.recipe.name, lowering=decision.lowering.value,
                         is_linear=decision.site.has_weight, op=decision.site.op)
        elif decision is not None:
            entry.update(kind="kept_site", label=f"{decision.site.op}: {decision.site.path or '<root>'}",
                         detail=decision.reason)
        else:
            target = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))
            entry["label"] = f"{target}"
        outline.append(entry)
    return outline


def _cut(text: str, limit: int = _MAX_LABEL) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _text_width(text: str, char_width: float = _CHAR_WIDTH) -> float:
    return len(text) * char_width + 2 * _PAD


def _short_path(path: str, group: Group) -> str:
    """A site's path inside its block's group, without the block's prefix every site there shares."""
    prefix = group.title + "."
    return path[len(prefix):] if group.is_block and path.startswith(prefix) else path


def _fp8_site_lines(entry: dict, group: Group) -> tuple[str, str]:
    return _cut(_short_path(entry["label"], group)), f"{entry['recipe']} · {entry['lowering']}"


def _port_label(port: Port, titles: list[str]) -> str:
    """``from <group> · <node>``, ``to <group>``; the ends of a list when there are many."""
    others = [titles[i] for i in port.groups]
    where = f"{others[0]} … {others[-1]} ({len(others)} groups)" if len(others) > 2 else ", ".join(others)
    if port.direction == "out":
        return _cut(f"to {where}", 72)
    what = port.nodes[0] if len(port.nodes) == 1 else f"{len(port.nodes)} values"
    return _cut(f"from {where} · {what}", 72)


def _box_size(entry: dict, group: Group) -> tuple[float, float]:
    """Width and height of a node's box, enough for its text."""
    kind = entry["kind"]
    if kind == "fp8_site":
        title, recipe = _fp8_site_lines(entry, group)
        return max(_text_width(title), _text_width(recipe, _SMALL_CHAR_WIDTH), 2 * _CHIP_WIDTH + 3 * 4), _SITE_HEIGHT
    if kind == "kept_site":
        return max(_text_width(_cut(entry["label"])), _text_width(_cut(entry["detail"]), _SMALL_CHAR_WIDTH)), _KEPT_HEIGHT
    return max(_text_width(_cut(entry["label"])), 40), _OP_HEIGHT


def _text(x, y, text, css_class="label"):
    return f'<text class="{css_class}" x="{x:.0f}" y="{y:.0f}">{html.escape(str(text))}</text>'


def _rect(box, css_class=None, extra=""):
    class_attribute = f' class="{css_class}"' if css_class else ""
    return (f'<rect{class_attribute} x="{box.x:.0f}" y="{box.y:.0f}" width="{box.w:.0f}" '
            f'height="{box.h:.0f}"{extra} />')


def _fp8_site_svg(entry: dict, box, group: Group, colour: str) -> str:
    """A site as a framed box in its recipe's colour: its path, recipe and lowering, then its four stages."""
    operands = ("input", "weight") if entry["is_linear"] else ("a", "b")
    stages = [("quantize", f"quantize {operands[0]}"), ("quantize", f"quantize {operands[1]}"),
              ("scaled-gemm", "scaled GEMM"), ("dequantize", "dequantize")]
    title, recipe = _fp8_site_lines(entry, group)
    parts = [f'<g class="graph-node fp8-site" data-node="{entry["name"]}" data-recipe="{html.escape(entry["recipe"])}">',
             f"<title>{html.escape(entry['label'])}: {html.escape(recipe)} ({entry['name']})</title>",
             _rect(box, "frame", f' stroke="{colour}"'),
             _text(box.x + _PAD, box.y + 15, title), _text(box.x + _PAD, box.y + 29, recipe, "detail")]
    chips_left = box.x + (box.w - 2 * _CHIP_WIDTH - 4) / 2  # both columns centred in the frame
    for index, (css_class, label) in enumerate(stages):
        x = chips_left + (index % 2) * (_CHIP_WIDTH + 4)
        y = box.y + 36 + (index // 2) * (_CHIP_HEIGHT + 3)
        parts.append(f'<rect class="stage {css_class}" x="{x:.0f}" y="{y:.0f}" width="{_CHIP_WIDTH}" '
                     f'height="{_CHIP_HEIGHT}" fill="{colour}" />')
        parts.append(_text(x + 6, y + 12, label, "stage-label"))
    parts.append("</g>")
    return "".join(parts)


def _plain_node_svg(entry: dict, box) -> str:
    """An op, a graph input or output, or a kept site (outlined, with its reason)."""
    where = "" if entry["kind"] == "io" else f", in {entry['module'] or '<root>'}"
    title = f"{entry['label']} ({entry['name']}{where})"
    if entry["detail"]:
        title += f": {entry['detail']}"
    text_y = box.y + 16 if not entry["detail"] else box.y + 15
    return (f'<g class="graph-node {entry["kind"].replace("_", "-")}" data-node="{entry["name"]}">'
            f"<title>{html.escape(title)}</title>{_rect(box)}"
            + _text(box.x + _PAD, text_y, _cut(entry["label"]))
            + (_text(box.x + _PAD, box.y + 30, _cut(entry["detail"]), "detail") if entry["detail"] else "")
            + "</g>")


def _port_svg(port: Port, box, label: str, anchors: list[str], titles: list[str]) -> str:
    """A port: a small dashed box naming the other group(s), linking to the first of them."""
    verb = "brings in" if port.direction == "in" else "sends out"
    tooltip = f"{verb} {', '.join(port.nodes)}; {'from' if port.direction == 'in' else 'to'} " + ", ".join(
        titles[i] for i in port.groups)
    return (f'<a href="#{anchors[port.groups[0]]}"><g class="port {port.direction}" data-port="{html.escape(port.id)}" '
            f'data-nodes="{" ".join(port.nodes)}"><title>{html.escape(tooltip)}</title>'
            f'{_rect(box)}{_text(box.x + _PAD, box.y + 14, label, "port-label")}</g></a>')


def _attach_points(layout: GroupLayout) -> dict[tuple[tuple[str, str], str], float]:
    """Where each edge leaves its source's bottom and enters its target's top.

    Edges at one box are spread along its side in the order of where they
    come from or go to, so they neither cross next to the box nor meet in one point.
    """
    ends = collections.defaultdict(list)  # (box id, "top" or "bottom") -> [(other end's x, edge)]
    for edge, points in layout.routes.items():
        ends[edge[0], "bottom"].append((points[1][0], edge))
        ends[edge[1], "top"].append((points[-2][0], edge))
    attach = {}
    for (box_id, side), edges in ends.items():
        box = layout.boxes[box_id]
        step = min(10.0, (box.w - 2 * _PAD) / max(len(edges), 1))
        for index, (_, edge) in enumerate(sorted(edges)):
            attach[edge, side] = box.x + box.w / 2 + (index - (len(edges) - 1) / 2) * step
    return attach


def _edge_svg(edge: tuple[str, str], points, attach, layout: GroupLayout) -> str:
    """An edge through grandalf's points, as vertical-tangent curves between consecutive ranks."""
    source, target = layout.boxes[edge[0]], layout.boxes[edge[1]]
    points = [(attach[edge, "bottom"], source.y + source.h), *points[1:-1], (attach[edge, "top"], target.y)]
    path = f"M{points[0][0]:.0f},{points[0][1]:.0f}"
    for (x0, y0), (x1, y1) in itertools.pairwise(points):
        middle = (y0 + y1) / 2
        path += f" C{x0:.0f},{middle:.0f} {x1:.0f},{middle:.0f} {x1:.0f},{y1:.0f}"
    return f'<path class="edge" data-from="{html.escape(edge[0])}" data-to="{html.escape(edge[1])}" d="{path}" />'


def _group_svg(group: Group, colours: dict[str, str], anchors: list[str], titles: list[str]) -> str:
    entries = {entry["name"]: entry for entry in group.entries}
    ports = {port.id: port for port in group.ports}
    port_labels = {port.id: _port_label(port, titles) for port in group.ports}

    def size_of(node_id: str) -> tuple[float, float]:
        if node_id in ports:
            return _text_width(port_labels[node_id], _SMALL_CHAR_WIDTH), _PORT_HEIGHT
        return _box_size(entries[node_id], group)

    layout = layout_group(group, size_of)
    attach = _attach_points(layout)
    edges = [_edge_svg(edge, points, attach, layout) for edge, points in layout.routes.items()]
    boxes = []
    for node_id, box in layout.boxes.items():
        if node_id in ports:
            boxes.append(_port_svg(ports[node_id], box, port_labels[node_id], anchors, titles))
        elif entries[node_id]["kind"] == "fp8_site":
            boxes.append(_fp8_site_svg(entries[node_id], box, group, colours[entries[node_id]["recipe"]]))
        else:
            boxes.append(_plain_node_svg(entries[node_id], box))
    width, height = round(layout.width), round(layout.height)
    return (f'<svg xmlns="http://www.w3.org/2000/svg" class="group-graph" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}">{"".join(edges)}{"".join(boxes)}</svg>')


def _group_summary(group: Group, colours: dict[str, str]) -> str:
    """Module path, ops, FP8 sites per recipe (in its colour) and kept sites, on one line."""
    ops = sum(entry["kind"] != "io" for entry in group.entries)
    recipes = collections.Counter(e["recipe"] for e in group.entries if e["kind"] == "fp8_site")
    reasons = collections.Counter(e["detail"] for e in group.entries if e["kind"] == "kept_site")
    parts = [f'<span class="group-path">{html.escape(group.title)}</span>', f"{ops} ops"]
    if recipes:
        parts.append("FP8 " + " ".join(
            f'<span class="chip" style="background:{colours[recipe]}">{count} {html.escape(recipe)}</span>'
            for recipe, count in recipes.items()))
    if reasons:
        why = "; ".join(f"{count}: {reason}" for reason, count in reasons.items())
        parts.append(f'<span class="kept" title="{html.escape(why)}">{sum(reasons.values())} kept</span>')
    return " · ".join(parts)


def _graph_html(index: int, outline: list[dict], colours: dict[str, str]) -> str:
    """A graph as its groups, each a <details>: open unless it is a block after the graph's first."""
    groups = group_outline(outline)
    anchors = [f"graph{index}-group{group.index}" for group in groups]
    titles = [group.title for group in groups]
    first_block = next((group.index for group in groups if group.is_block), None)
    sections = []
    for group in groups:
        is_open = not group.is_block or group.index == first_block
        sections.append(
            f'<details class="graph-group{" block" if group.is_block else ""}" id="{anchors[group.index]}"'
            f'{" open" if is_open else ""}><summary>{_group_summary(group, colours)}</summary>'
            f'<div class="scroll">{_group_svg(group, colours, anchors, titles)}</div></details>')
    blocks = sum(group.is_block for group in groups)
    toolbar = (f'<p class="toolbar" data-graph="{index}"><button data-open="1">open all groups</button> '
               f'<button data-open="0">close all blocks</button></p>' if blocks > 1 else "")
    grouping = f" in {len(groups)} groups, {blocks} of them repeated blocks" if blocks else ""
    return (f"<h2>Graph {index} (rewritten): {len(outline)} nodes{grouping}</h2>"
            f'<div class="graph" id="graph{index}">{toolbar}{"".join(sections)}</div>')


_STYLE = """
body { font-family: sans-serif; margin: 1.5em; color: #222; }
table { border-collapse: collapse; font-size: 13px; }
td, th { border: 1px solid #ccc; padding: 3px 8px; text-align: left; }
.kept { color: #8a6d00; }
svg text { font-size: 11px; font-family: "DejaVu Sans Mono", monospace; fill: #222; }
svg text.detail, svg text.stage-label, svg text.port-label { font-size: 10px; }
svg rect { rx: 4px; }
.edge { fill: none; stroke: #8c8c8c; stroke-width: 1.2; marker-end: url(#arrow); }
.graph-node.op rect { fill: #f4f4f4; stroke: #888; }
.graph-node.io rect { fill: #e8eef7; stroke: #5b7bb0; rx: 11px; }
.graph-node.kept-site rect { fill: #fff8e1; stroke: #c99a00; stroke-width: 2; stroke-dasharray: 4 2; }
.graph-node.kept-site text.detail { fill: #8a6d00; }
.fp8-site .frame { fill: #fff; stroke-width: 2.5; }
.fp8-site .stage-label { fill: #fff; }
.port rect { fill: #fafafa; stroke: #aaa; stroke-dasharray: 3 2; rx: 10px; }
.port text { fill: #555; }
a:hover .port rect { stroke: #333; }
.legend span { display: inline-block; padding: 2px 10px; margin-right: 8px; color: #fff; border-radius: 4px; }
.legend span.kept-legend { color: #8a6d00; background: #fff8e1; border: 2px dashed #c99a00; }
details { margin: 0.6em 0; }
details.graph-group { border: 1px solid #ddd; border-radius: 6px; padding: 0.2em 0.6em; }
details.graph-group > summary { cursor: pointer; font-size: 14px; padding: 0.3em 0; }
.group-path { font-family: monospace; font-weight: bold; }
.chip { color: #fff; border-radius: 4px; padding: 1px 6px; font-size: 12px; }
.scroll { overflow-x: auto; }
"""

# One arrowhead for every edge of the page (each group's SVG refers to it).
_ARROW_DEFS = ('<svg width="0" height="0" style="position:absolute" aria-hidden="true"><defs>'
               '<marker id="arrow" viewBox="0 0 8 8" refX="8" refY="4" markerWidth="7" markerHeight="7" '
               'orient="auto"><path d="M0,0 L8,4 L0,8 z" fill="#8c8c8c" /></marker></defs></svg>')

_SCRIPT = """
<script>
// A port links to its other group: open that group when a link (or the address) names it.
const openGroup = (id) => { const group = document.getElementById(id); if (group) group.open = true; };
document.addEventListener("click", (event) => {
  const link = event.target.closest("a[href^='#']");
  if (link) openGroup(link.getAttribute("href").slice(1));
});
openGroup(location.hash.slice(1));
document.querySelectorAll(".toolbar button").forEach((button) => button.addEventListener("click", () => {
  const open = button.dataset.open === "1";
  button.closest(".graph").querySelectorAll(open ? "details.graph-group" : "details.graph-group.block")
    .forEach((d) => { d.open = open; });
}));
// Record how many drawn nodes have a laid-out box, so a headless browser can check the drawing:
// every group is opened for the count (a collapsed one lays nothing out), then put back.
window.addEventListener("load", () => {
  const groups = [...document.querySelectorAll("details.graph-group")];
  const wasOpen = groups.map((d) => d.open);
  groups.forEach((d) => { d.open = true; });
  const laidOut = (sel) => [...document.querySelectorAll(sel)]
    .filter((e) => { const b = e.getBBox(); return b.width > 0 && b.height > 0; }).length;
  document.body.dataset.renderedNodes = laidOut(".graph-node");
  document.body.dataset.renderedFp8Sites = laidOut(".fp8-site");
  document.body.dataset.renderedPorts = laidOut(".port");
  groups.forEach((d, i) => { d.open = wasOpen[i]; });
});
</script>
"""


def render_html(report) -> str:
    """The whole page for an :class:`fp8graph.ExplainReport` (needs grandalf to lay the graphs out)."""
    recipes = sorted({str(r.recipe) for r in report.rewritten})
    colours = dict(zip(recipes, itertools.cycle(_PALETTE)))
    rows = "".join(
        "<tr>" + "".join(f"<td>{html.escape(str(v))}</td>" for v in (
            r.path or "<root>", r.op, r.M, r.K, r.N, "-" if r.experts is None else r.experts,
            str(r.dtype).removeprefix("torch."))) +
        (f'<td style="color:{colours[str(r.recipe)]}">{html.escape(str(r.recipe))}</td>' if r.rewritten
         else f'<td class="kept">{html.escape(str(r.reason))}</td>') +
        f"<td>{html.escape(str(r.lowering or '-'))}</td><td>{html.escape(r.rule)}</td></tr>"
        for r in report)
    legend = "".join(f'<span style="background:{colour}">{html.escape(recipe)}</span>'
                     for recipe, colour in colours.items())
    legend += '<span class="kept-legend">kept in high precision</span>' if report.kept else ""
    graphs = "".join(
        _graph_html(index, outline, colours)
        + f"<details><summary>code of graph {index}</summary><pre>{html.escape(code)}</pre></details>"
        for index, (outline, code) in enumerate(zip(report.graph_outlines, report.graph_code)))
    summary = "".join(f"<li>{html.escape(line)}</li>" for line in report.summary_lines())
    unmatched = "".join(f"<li>policy rule matched no site: {html.escape(r)}</li>" for r in report.unmatched_rules)
    return (
        "<!DOCTYPE html><html><head><meta charset='utf-8'><title>fp8graph report</title>"
        f"<style>{_STYLE}</style></head><body>{_ARROW_DEFS}"
        f"<h1>fp8graph: {len(report.rewritten)} of {len(report)} sites in FP8</h1>"
        f"<ul>{summary}{unmatched}</ul><p class='legend'>{legend}</p>"
        "<table><tr><th>module path</th><th>op</th><th>M</th><th>K</th><th>N</th><th>E</th><th>input dtype</th>"
        f"<th>FP8 recipe / reason kept</th><th>lowering</th><th>decided by</th></tr>{rows}</table>"
        f"{graphs}{_SCRIPT}</body></html>"
    )
