"""Where the HTML report draws each node: groups by module, each laid out by grandalf.

A rewritten graph of a whole model holds every decoder layer; drawn as one
picture its edges cross the page. So the nodes are first split into groups:

* a node inside a repeated block belongs to that block's group. The block is
  the module path up to its first numeric component, the index into a
  ``ModuleList`` or ``Sequential``: ``model.layers.3.mlp.up_proj`` is in
  ``model.layers.3``;
* the other nodes (the graph's inputs and output, embeddings, final norm,
  head, and every node of a graph without blocks, such as a regional
  block's own graph) form one group per run between blocks, in graph order:
  before the first block, between two blocks, after the last. A group of
  these is named after the outermost modules its ops ran in.

An edge between two groups is cut in two: the consumer's group gets an *in
port* standing for the outside node ("from model.layers.2"), the producer's
group an *out port* naming the groups that read it ("to lm_head"). So every
drawn edge stays inside one group's picture.

Each group, ports included, is then laid out by grandalf's Sugiyama layout,
the layered algorithm of Graphviz ``dot`` in pure Python: ranks from the
inputs down, crossings reduced by barycenter sweeps, x coordinates by
Brandes and Köpf. An edge spanning several ranks bends through grandalf's
dummy vertices; the page draws it through those points. grandalf is imported
only here, when a page is rendered, so ``import fp8graph`` never needs it.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Callable

__all__ = ["Box", "Group", "GroupLayout", "Port", "block_path", "group_outline", "layout_group"]

MARGIN = 14  # around a group's picture
X_GAP, Y_GAP = 22, 30  # between neighbours in a rank, and between ranks (room for the edges' curves)
COMPONENT_GAP = 36  # between the unconnected pieces of one group, placed side by side
# A dummy vertex is where a long edge crosses a rank. grandalf sizes them as the
# median node by default, which would spread parallel long edges a box apart.
DUMMY_WIDTH, DUMMY_HEIGHT = 6, 6
MAX_PORTS_PER_NODE = 3  # a node with more inputs from other groups gets them through one port
ORDERING_ROUNDS = 4  # crossing-reduction sweeps (grandalf's default is 1.5)


@dataclasses.dataclass
class Port:
    """The stand-in, inside one group, for the other end of edges that leave or enter it.

    An in port brings in one outside node, or gathers all the outside inputs
    of one node that reads many (the graph's output collecting every layer's
    cache); an out port sends one inside node to the groups that read it.
    ``groups`` are the indices of the groups at the other end.
    """

    id: str  # "in:<node>", "in:<reader>:gathered" or "out:<node>"; ':' never appears in an FX name
    direction: str  # "in" or "out"
    nodes: list[str]  # the outside nodes brought in, or the inside node sent out
    groups: list[int]


@dataclasses.dataclass
class Group:
    """One collapsible section of the page: its nodes, ports and the edges among them."""

    index: int
    title: str
    is_block: bool
    entries: list[dict]
    ports: list[Port] = dataclasses.field(default_factory=list)
    edges: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # node names and port ids


@dataclasses.dataclass(frozen=True)
class Box:
    x: float  # top-left corner
    y: float
    w: float
    h: float


@dataclasses.dataclass
class GroupLayout:
    """Boxes by node name or port id, each edge's points from its source box to its target box."""

    boxes: dict[str, Box]
    routes: dict[tuple[str, str], list[tuple[float, float]]]
    width: float
    height: float


def block_path(module_path: str) -> str | None:
    """The repeated block holding ``module_path`` (up to its first index), or ``None`` outside any."""
    parts = module_path.split(".")
    for index, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: index + 1])
    return None


def _outer_paths(paths: list[str]) -> list[str]:
    """The distinct paths, each replaced by its outermost ancestor among them, in first-seen order."""
    present = set(paths)
    outer = []
    for path in paths:
        parts = path.split(".")
        ancestor = next(".".join(parts[:n]) for n in range(1, len(parts) + 1) if ".".join(parts[:n]) in present)
        if ancestor not in outer:
            outer.append(ancestor)
    return outer


def _run_title(entries: list[dict]) -> str:
    """A name for nodes outside blocks: the modules they ran in, outermost first seen."""
    modules = _outer_paths([e["module"] for e in entries if e["module"] and e["kind"] != "io"])
    if not modules and all(e["kind"] == "io" for e in entries):
        return "graph output" if any(e["inputs"] for e in entries) else "graph inputs"
    if not modules:
        return "<root>"
    return ", ".join(modules[:4]) + (", …" if len(modules) > 4 else "")


def _split_into_groups(outline: list[dict]) -> list[Group]:
    key_order: list[tuple] = []
    members: dict[tuple, list[dict]] = {}
    blocks_seen: set[str] = set()
    for entry in outline:
        # A graph input's module is only where it is first read: inputs stay with the graph's runs.
        block = block_path(entry["module"]) if entry["kind"] != "io" else None
        if block is not None:
            blocks_seen.add(block)
            key = ("block", block)
        else:  # the run of non-block nodes since the last new block
            key = ("run", len(blocks_seen))
        if key not in members:
            key_order.append(key)
            members[key] = []
        members[key].append(entry)
    return [Group(index, key[1] if key[0] == "block" else _run_title(members[key]), key[0] == "block", members[key])
            for index, key in enumerate(key_order)]


def _cut_edges_between_groups(groups: list[Group]) -> None:
    """Fill each group's edges, replacing an edge between two groups by a port at each end."""
    group_of = {entry["name"]: group.index for group in groups for entry in group.entries}
    ports: dict[tuple[int, str], Port] = {}

    def port(group: Group, port_id: str, direction: str) -> Port:
        if (group.index, port_id) not in ports:
            ports[group.index, port_id] = Port(port_id, direction, [], [])
            group.ports.append(ports[group.index, port_id])
        return ports[group.index, port_id]

    def add(items: list, item) -> None:
        if item not in items:
            items.append(item)

    for group in groups:
        for entry in group.entries:
            outside = [source for source in entry["inputs"] if group_of[source] != group.index]
            for source in entry["inputs"]:  # distinct inputs: one edge per (source, reader)
                if source not in outside:
                    group.edges.append((source, entry["name"]))
                    continue
                # One port per outside input reads best, but a node with many (say every
                # layer's cache) would get a rank of ports as wide as the model is deep.
                gathered = len(outside) > MAX_PORTS_PER_NODE
                incoming = port(group, f"in:{entry['name']}:gathered" if gathered else f"in:{source}", "in")
                add(group.edges, (incoming.id, entry["name"]))  # a gathered port's edge is added once
                add(incoming.nodes, source)
                add(incoming.groups, group_of[source])
                outgoing = port(groups[group_of[source]], f"out:{source}", "out")
                if not outgoing.nodes:
                    groups[group_of[source]].edges.append((source, outgoing.id))
                    outgoing.nodes.append(source)
                add(outgoing.groups, group.index)


def group_outline(outline: list[dict]) -> list[Group]:
    """Split a graph outline (``report_html.graph_outline``) into groups by module, in graph order."""
    groups = _split_into_groups(outline)
    _cut_edges_between_groups(groups)
    return groups


def _grandalf():
    try:
        from grandalf.graphs import Edge, Vertex, graph_core
        from grandalf.layouts import SugiyamaLayout
    except ImportError as error:
        raise ImportError("the HTML report lays its graphs out with grandalf: pip install grandalf "
                          "(it comes with fp8graph's demo and test extras)") from error
    return Vertex, Edge, graph_core, SugiyamaLayout


def _components(ids: list[str], edges: list[tuple[str, str]]) -> list[tuple[list[str], list[tuple[str, str]]]]:
    """The connected pieces, each with its nodes and edges in the given order.

    Made here rather than by grandalf's ``Graph``, which collects a piece's
    edges in a set: their order, and with it the layout, would change from run to run.
    """
    piece = {node_id: node_id for node_id in ids}

    def root(node_id):
        while piece[node_id] != node_id:
            node_id = piece[node_id]
        return node_id

    for source, target in edges:
        piece[root(target)] = root(source)
    members = collections.defaultdict(lambda: ([], []))
    for node_id in ids:  # pieces in the order of their first node
        members[root(node_id)][0].append(node_id)
    for edge in edges:
        members[root(edge[0])][1].append(edge)
    return list(members.values())


class _View:
    """What grandalf reads of a vertex (``w``, ``h``) and writes back (``xy``, its centre)."""

    def __init__(self, w: float, h: float):
        self.w, self.h, self.xy = w, h, None


class _Route:
    """What grandalf writes of an edge: the points it passes, centre of source to centre of target."""

    points: list[tuple[float, float]] = []

    def setpath(self, points):
        self.points = points


def _layout_component(component, order: dict[str, int], SugiyamaLayout) -> None:
    """Let grandalf place one connected piece; results land in the views."""
    # Roots in graph order, so the first ordering sweep starts from the code's order.
    roots = sorted((v for v in component.sV if not v.e_in()), key=lambda v: order[v.data])
    for optimize in (True, False):
        sugiyama = SugiyamaLayout(component)
        sugiyama.xspace, sugiyama.yspace = X_GAP, Y_GAP
        sugiyama.dw, sugiyama.dh = DUMMY_WIDTH, DUMMY_HEIGHT
        # Optimized ranks move a node down to just above its first reader (a constant, an in
        # port), instead of an edge from the top rank down the whole picture.
        sugiyama.init_all(roots=roots, optimize=optimize)
        if all(sugiyama.layers):  # grandalf cannot place an emptied rank: rank without moving then
            break
    sugiyama.draw(ORDERING_ROUNDS)


def layout_group(group: Group, size_of: Callable[[str], tuple[float, float]]) -> GroupLayout:
    """Place a group's nodes and ports (``size_of(id)`` gives each box's width and height)."""
    Vertex, Edge, graph_core, SugiyamaLayout = _grandalf()
    ids = ([p.id for p in group.ports if p.direction == "in"] + [e["name"] for e in group.entries]
           + [p.id for p in group.ports if p.direction == "out"])
    order = {node_id: index for index, node_id in enumerate(ids)}
    boxes: dict[str, Box] = {}
    routes: dict[tuple[str, str], list[tuple[float, float]]] = {}
    left, height = MARGIN, 0.0
    # Unconnected pieces side by side, in graph order of their first node.
    for piece_ids, piece_edges in _components(ids, group.edges):
        vertices = {node_id: Vertex(node_id) for node_id in piece_ids}
        for node_id, vertex in vertices.items():
            vertex.view = _View(*size_of(node_id))
        edges = [Edge(vertices[source], vertices[target]) for source, target in piece_edges]
        for edge in edges:
            edge.view = _Route()
        if len(vertices) > 1:
            _layout_component(graph_core(list(vertices.values()), edges), order, SugiyamaLayout)
        else:
            vertices[piece_ids[0]].view.xy = (0.0, 0.0)
        views = [v.view for v in vertices.values()]
        points = [point for edge in edges for point in edge.view.points]
        min_x = min([v.xy[0] - v.w / 2 for v in views] + [x for x, _ in points])
        max_x = max([v.xy[0] + v.w / 2 for v in views] + [x for x, _ in points])
        dx, dy = left - min_x, MARGIN - min(v.xy[1] - v.h / 2 for v in views)
        for node_id, vertex in vertices.items():
            (cx, cy), w, h = vertex.view.xy, vertex.view.w, vertex.view.h
            boxes[node_id] = Box(cx + dx - w / 2, cy + dy - h / 2, w, h)
            height = max(height, boxes[node_id].y + h)
        for key, edge in zip(piece_edges, edges):
            routes[key] = [(x + dx, y + dy) for x, y in edge.view.points]
        left += max_x - min_x + COMPONENT_GAP
    return GroupLayout(boxes, routes, left - COMPONENT_GAP + MARGIN, height + MARGIN)
