"""The explain report: rows, counts, graph code and breaks, and the HTML page in a real headless browser."""

import collections
import html
import itertools
import os
import re
import shutil
import subprocess
import sys
import textwrap
from xml.etree import ElementTree

import pytest
import torch
from torch import nn

import fp8graph
from fp8graph import Float8CurrentScaling, Format, Policy
from fp8graph.models import build

E4M3 = Float8CurrentScaling(Format.E4M3)
MIXED = Policy(rules=[("lm_head", None), ("*.mlp.*", E4M3)])
# Colours the page gives the first two recipes (sorted by name): current(E4M3), current(HYBRID).
RECIPE_RGB = {"current(E4M3)": (0x1B, 0x9E, 0x77), "current(HYBRID)": (0xD9, 0x5F, 0x02)}


def _llama_report(regions=None):
    """The whole model in one graph by default, so one code listing holds every site."""
    return fp8graph.explain(build("llama", "tiny"), torch.randint(0, 250, (2, 16)), policy=MIXED, regions=regions)


def test_rows_counts_and_code():
    report = _llama_report()
    assert len(report) == 15
    assert report.recipe_counts == {"current(HYBRID)": 8, "current(E4M3)": 6}
    assert report.reason_counts == {"policy keeps it in high precision": 1}
    assert report.graph_count == 1 and report.graph_breaks == []
    [code] = report.graph_code
    # Per layer: q, k and v in one call (one input), o alone; gate and up in one call, down alone.
    assert code.count("fp8graph_linears_current_HYBRID_emulated(") == 2
    assert code.count("fp8graph_linear_current_HYBRID_emulated(") == 2
    assert code.count("fp8graph_linears_current_E4M3_emulated(") == 2
    assert code.count("fp8graph_linear_current_E4M3_emulated(") == 2
    text = str(report)
    assert "8 site(s) in FP8 with current(HYBRID)" in text and "1 graph(s), 0 graph break(s)" in text
    # Rows are data: the recipe object the policy gave, comparable and filterable by class.
    mlp_rows = [r for r in report if r.recipe == E4M3]
    assert len(mlp_rows) == 6 and all(".mlp." in r.path for r in mlp_rows)
    assert len([r for r in report if isinstance(r.recipe, fp8graph.Float8CurrentScaling)]) == 14
    # The same rows, counts and report with each decoder layer compiled once.
    regional = _llama_report(regions="auto")
    assert [(r.path, r.recipe, r.reason) for r in regional] == [(r.path, r.recipe, r.reason) for r in report]
    assert regional.graph_breaks == [] and regional.recipe_counts == report.recipe_counts


class TwoGraphs(nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(32, 32), nn.Linear(32, 32)

    def forward(self, x):
        x = self.first(x)
        print("a side effect Dynamo cannot trace")  # graph break
        return self.second(x)


def test_graph_breaks_are_counted_and_every_site_reported_once():
    report = fp8graph.explain(TwoGraphs(), torch.randn(4, 32))
    assert report.graph_count == 2 and len(report.graph_breaks) == 1
    assert [r.path for r in report] == ["first", "second"]


def _chromium():
    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    if binary is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is missing: scripts/test installs it")
        pytest.skip("chromium not installed (scripts/test installs it)")
    return [binary, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def test_html_page_draws_every_node_in_headless_chromium(tmp_path):
    report = _llama_report()
    page = report.to_html(tmp_path / "report.html")
    chromium = _chromium()
    dom = subprocess.run(chromium + [f"--user-data-dir={tmp_path / 'profile-dom'}", "--virtual-time-budget=3000",
                                     "--dump-dom", page.as_uri()],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    rendered = dict(re.findall(r'data-rendered-([a-z0-9-]+)="(\d+)"', dom))
    drawn = sum(len(outline) for outline in report.graph_outlines)
    assert int(rendered["nodes"]) == drawn > 100
    assert int(rendered["fp8-sites"]) == len(report.rewritten) == 14
    # Counted with every group opened: the second layer's group starts collapsed.
    assert int(rendered["ports"]) == page.read_text().count('<g class="port ') > 0
    assert page.read_text().count("<details class=\"graph-group block\" id=") == 2

    screenshot = tmp_path / "page.png"
    subprocess.run(chromium + [f"--user-data-dir={tmp_path / 'profile-png'}", "--window-size=1400,6000",
                               f"--screenshot={screenshot}", page.as_uri()],
                   capture_output=True, timeout=120, check=True)
    import matplotlib.image

    pixels = (matplotlib.image.imread(screenshot)[..., :3] * 255).round().astype(int)
    for recipe, rgb in RECIPE_RGB.items():
        matches = (pixels == torch.tensor(rgb).numpy()).all(axis=-1).sum()
        assert matches > 1000, f"{recipe} is not drawn in its colour"


# The page's groups, read back from its HTML: each group's SVG is well-formed XML.
_SVG = "{http://www.w3.org/2000/svg}"
_GROUP = re.compile(r'<details class="graph-group( block)?" id="([^"]+)"( open)?><summary>(.*?)</summary>'
                    r'<div class="scroll">(<svg .*?</svg>)</div></details>')


def _groups(page: str) -> list[dict]:
    """Each drawn group: id, block or not, open or not, summary text, title (its module path), SVG."""
    groups = []
    for match in _GROUP.finditer(page):
        summary = html.unescape(re.sub(r"<[^>]+>", "", match[4]))
        groups.append(dict(id=match[2], block=bool(match[1]), open=bool(match[3]), summary=summary,
                           title=summary.split(" · ")[0], svg=ElementTree.fromstring(match[5])))
    return groups


def _classes(element) -> list[str]:
    return element.get("class", "").split()


def _nodes(svg) -> list:
    return [g for g in svg.iter(_SVG + "g") if "graph-node" in _classes(g)]


def _ports(svg) -> dict:
    """``{port id: (port element, its link's href)}``."""
    return {link.find(_SVG + "g").get("data-port"): (link.find(_SVG + "g"), link.get("href"))
            for link in svg.iter(_SVG + "a")}


def _edges(svg) -> list[tuple[str, str, str]]:
    return [(path.get("data-from"), path.get("data-to"), path.get("d")) for path in svg.iter(_SVG + "path")
            if "edge" in _classes(path)]


def _box(element) -> tuple[float, float, float, float]:
    rect = element.find(_SVG + "rect")
    return tuple(float(rect.get(key)) for key in ("x", "y", "width", "height"))


@pytest.fixture(scope="module")
def four_layers(tmp_path_factory):
    """A 4-layer Llama in one graph (no regions): the report and its page."""
    model = build("llama", "tiny", num_hidden_layers=4)
    report = fp8graph.explain(model, torch.randint(0, 250, (2, 16)), policy=MIXED, regions=None)
    page = report.to_html(tmp_path_factory.mktemp("four-layers") / "report.html").read_text()
    return report, page


def test_html_groups_each_decoder_layer_in_its_own_collapsible_section(four_layers):
    report, page = four_layers
    groups = _groups(page)
    assert page.count("<details class=\"graph-group") == len(groups)  # every group parsed
    assert [g["title"] for g in groups] == ["model", *(f"model.layers.{i}" for i in range(4)), "model.norm, lm_head"]
    assert [g["block"] for g in groups] == [False, True, True, True, True, False]
    # The first layer is open to read; the others repeat it and start collapsed.
    assert [g["open"] for g in groups] == [True, True, False, False, False, True]
    for layer in groups[1:5]:  # the summary: ops, FP8 sites per recipe (MIXED: MLP in E4M3)
        assert re.search(r" · \d+ ops · FP8 4 current\(HYBRID\) 3 current\(E4M3\)$", layer["summary"])
    assert groups[-1]["summary"].endswith("1 kept")  # lm_head

    [outline] = report.graph_outlines
    drawn_in = collections.defaultdict(list)
    for group in groups:
        for node in _nodes(group["svg"]):
            drawn_in[node.get("data-node")].append(group["title"])
    assert sorted(drawn_in) == sorted(entry["name"] for entry in outline)
    assert all(len(titles) == 1 for titles in drawn_in.values())  # every node drawn exactly once
    for entry in outline:  # ... in its layer's group, when it ran in a layer
        layer = re.match(r"model\.layers\.\d+", entry["module"])
        if layer and entry["kind"] != "io":
            assert drawn_in[entry["name"]] == [layer[0]], entry
        else:
            assert not drawn_in[entry["name"]][0].startswith("model.layers."), entry


def test_html_edges_leave_a_group_only_through_ports(four_layers):
    report, page = four_layers
    [outline] = report.graph_outlines
    groups = _groups(page)
    group_of = {node.get("data-node"): group["id"] for group in groups for node in _nodes(group["svg"])}
    inputs = {entry["name"]: set(entry["inputs"]) for entry in outline}
    titles = {group["id"]: group["title"] for group in groups}
    expected_pairs = {(source, entry["name"]) for entry in outline for source in entry["inputs"]}
    pairs_drawn = set()
    for group in groups:
        nodes = {node.get("data-node") for node in _nodes(group["svg"])}
        ports = _ports(group["svg"])
        port_nodes = {port_id: port.get("data-nodes").split() for port_id, (port, _) in ports.items()}
        for source, target, _ in _edges(group["svg"]):
            assert {source, target} <= nodes | set(ports)  # both ends drawn in this group's picture
            if source in nodes and target in nodes:
                pairs_drawn.add((source, target))
            elif source in ports:  # an in port: outside nodes this node reads
                assert target in nodes and ports[source][0].get("class") == "port in"
                brought = port_nodes[source]
                assert all(group_of[n] != group["id"] for n in brought) and set(brought) <= inputs[target]
                pairs_drawn.update((n, target) for n in brought)
            else:  # an out port: a node read by other groups, linked to (the first of) them
                port, href = ports[target]
                assert port.get("class") == "port out" and port_nodes[target] == [source]
                readers = {group_of[name] for name, read in inputs.items() if source in read} - {group["id"]}
                assert href[1:] in readers
                label = port.find(_SVG + "text").text
                assert label.startswith("to ") and titles[href[1:]] in label
    assert pairs_drawn == expected_pairs  # every edge of the graph drawn, none invented


def test_html_layout_is_grandalf_layered_without_overlaps(four_layers, tmp_path, monkeypatch):
    report, page = four_layers
    for group in _groups(page):
        svg = group["svg"]
        boxes = {node.get("data-node"): _box(node) for node in _nodes(svg)}
        boxes.update({port_id: _box(port) for port_id, (port, _) in _ports(svg).items()})
        width, height = float(svg.get("width")), float(svg.get("height"))
        for name, (x, y, w, h) in boxes.items():
            assert 0 <= x and x + w <= width and 0 <= y and y + h <= height, name
        for (a, (ax, ay, aw, ah)), (b, (bx, by, bw, bh)) in itertools.combinations(boxes.items(), 2):
            assert ax + aw <= bx or bx + bw <= ax or ay + ah <= by or by + bh <= ay, f"{a} overlaps {b}"
        for source, target, path in _edges(svg):  # top to bottom: bottom of the source to top of the target
            coordinates = [float(v) for v in re.findall(r"-?[\d.]+", path)]
            (sx, sy, sw, sh), (tx, ty, tw, th) = boxes[source], boxes[target]
            assert coordinates[1] == round(sy + sh) and coordinates[-1] == round(ty) and sy + sh < ty
            assert sx <= coordinates[0] <= sx + sw and tx <= coordinates[-2] <= tx + tw
    # The coordinates are grandalf's: its Sugiyama layout places every group.
    from grandalf.layouts import SugiyamaLayout

    placed, draw = [], SugiyamaLayout.draw
    monkeypatch.setattr(SugiyamaLayout, "draw", lambda self, *a: (placed.append(self), draw(self, *a))[1])
    report.to_html(tmp_path / "again.html")
    assert len(placed) >= len(_groups(page)) == 6
    assert (tmp_path / "again.html").read_text() == page  # and deterministically


class Residual(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(width), nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x):  # x: (batch, width)
        return x + self.down(torch.relu(self.up(self.norm(x))))


class DeepStack(nn.Module):
    """32 small residual blocks in a ModuleList and a head: a deep model that traces in a second."""

    def __init__(self, layers=32, width=32):
        super().__init__()
        self.layers = nn.ModuleList(Residual(width) for _ in range(layers))
        self.head = nn.Linear(width, 10)

    def forward(self, x):  # x: (batch, width)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def test_html_page_of_32_layers_stays_small_with_the_layers_collapsed(tmp_path):
    report = fp8graph.explain(DeepStack(), torch.randn(4, 32), regions=None)
    page = report.to_html(tmp_path / "report.html").read_text()
    groups = _groups(page)
    assert [g["title"] for g in groups] == ["graph inputs", *(f"layers.{i}" for i in range(32)), "head"]
    assert [g["title"] for g in groups if g["open"]] == ["graph inputs", "layers.0", "head"]
    drawn = [node.get("data-node") for group in groups for node in _nodes(group["svg"])]
    assert sorted(drawn) == sorted(entry["name"] for entry in report.graph_outlines[0])
    # Each layer drawn once, in its own small picture: the page grows by a few kB per layer
    # (about 240 kB here, a third of it the graph's code), not with the square of the depth.
    assert len(page.encode()) < 350_000
    assert max(float(g["svg"].get("width")) for g in groups) < 600


def test_html_graph_without_blocks_is_one_open_group(tmp_path):
    report = fp8graph.explain(TwoGraphs(), torch.randn(4, 32))
    groups = _groups(report.to_html(tmp_path / "report.html").read_text())
    assert [(g["title"], g["open"], len(_nodes(g["svg"]))) for g in groups] == [("first", True, 3), ("second", True, 3)]


def test_html_needs_grandalf_only_to_render(tmp_path):
    """grandalf is an extra: fp8graph imports and explains without it, and to_html says how to get it."""
    script = textwrap.dedent("""
        import sys
        sys.modules["grandalf"] = None  # as if it were not installed
        import torch
        import fp8graph
        report = fp8graph.explain(torch.nn.Linear(32, 32), torch.randn(4, 32))
        try:
            report.to_html(sys.argv[1])
        except ImportError as error:
            print("ImportError:", error)
    """)
    result = subprocess.run([sys.executable, "-c", script, str(tmp_path / "report.html")],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "ImportError:" in result.stdout and "pip install grandalf" in result.stdout
    assert not (tmp_path / "report.html").exists()


def test_nodes_reached_through_a_hook_are_named_by_the_model_s_module_paths(tmp_path):
    # stats=True hooks every module; the hook's closure holds the root, so Dynamo's source path of what
    # it runs is "embed_tokens._forward_hooks[...].__closure__.0". explain names modules as the model
    # does, so the page's groups are the model's modules (before, that closure path became a "block").
    model = build("llama", "tiny")
    fp8graph.compile(model, compiler="aot_eager", stats=True)
    report = fp8graph.explain(model, torch.randint(0, 250, (2, 16)), regions=None)
    module_names = {name for name, _ in model.named_modules()}
    [outline] = report.graph_outlines
    assert {entry["module"] for entry in outline} <= module_names
    page = report.to_html(tmp_path / "report.html").read_text()
    titles = re.findall(r'<span class="group-path">([^<]*)', page)
    assert titles == ["model", "model.layers.0", "model.layers.1", "model.norm, lm_head"]


def test_each_site_carries_its_modelled_times_on_the_named_gpu():
    """A rewritten site: in its recipe; a kept one: in the policy's default recipe; no GPU: no column."""
    model, tokens = build("llama", "tiny"), torch.randint(0, 250, (2, 16))
    report = fp8graph.explain(model, tokens, policy=MIXED, gpu="B200")
    head = next(record for record in report if record.path == "lm_head")
    gate = next(record for record in report if record.path.endswith("mlp.gate_proj"))
    assert head.modelled.gpu == gate.modelled.gpu == "B200"
    assert head.modelled.recipe == gate.modelled.recipe == "current"
    assert (head.modelled.M, head.modelled.bf16_us) == (32, 15.0)  # three GEMMs at the 5 us floor
    assert "B200 us BF16 / FP8" in str(report) and "15.0 / " in str(report)
    bare = fp8graph.explain(model, tokens, policy=MIXED, gpu=None)
    assert all(record.modelled is None for record in bare) and "us BF16 / FP8" not in str(bare)
    with pytest.raises(ValueError, match="no rates for GPU 'V100'"):
        fp8graph.explain(model, tokens, gpu="V100")


def test_explain_of_a_compiled_model_refuses_settings_it_would_not_use():
    """A compiled model is explained with its own policy, lowering and regions: one given would be ignored."""
    model, tokens = build("llama", "tiny"), torch.randint(0, 250, (2, 16))
    compiled = fp8graph.compile(model, compiler="aot_eager")
    for setting in ({"policy": MIXED}, {"lowering": "emulated"}, {"regions": None}):
        with pytest.raises(ValueError, match="explained with its own policy, lowering and regions"):
            fp8graph.explain(compiled, tokens, **setting)
    assert len(fp8graph.explain(compiled, tokens)) > 0


def test_explain_of_an_uncompiled_model_leaves_its_modules_classes_as_they_were():
    model = build("llama", "tiny")
    classes = {path: type(module) for path, module in model.named_modules()}
    report = fp8graph.explain(model, torch.randint(0, 250, (2, 16)))  # regions="auto": its layers are regions
    assert report.graph_count > 1
    assert {path: type(module) for path, module in model.named_modules()} == classes


@pytest.mark.parametrize("compiled", [False, True])
def test_explain_leaves_a_training_models_buffers_and_random_state_as_they_were(compiled):
    """explain's run is a forward in training mode: it updated a BatchNorm's running statistics and drew dropout
    masks. Both are given back: the buffers bit for bit, the generator where it was (the next draw the same);
    the model stays in training mode."""
    net = nn.Sequential(nn.Linear(64, 128), nn.BatchNorm1d(128), nn.ReLU(), nn.Dropout(0.5), nn.Linear(128, 64))
    x = torch.randn(32, 64)
    model = fp8graph.compile(net, compiler="aot_eager") if compiled else net
    if compiled:
        model(x).sum().backward()
    norm = net[1]
    before = {name: buffer.clone() for name, buffer in norm.named_buffers()}
    torch.manual_seed(5)
    report = fp8graph.explain(model, x)
    after_explain = torch.rand(4)
    torch.manual_seed(5)
    assert torch.equal(after_explain, torch.rand(4))
    assert len(report.rewritten) == 2 and model.training and norm.training
    for name, buffer in norm.named_buffers():
        assert torch.equal(buffer, before[name]), name
    assert int(norm.num_batches_tracked) == (1 if compiled else 0)


class _GainAndCache(nn.Module):
    """A buffer the backward saves (``gain``) and a cache the forward rebuilds, with an attribute saying its
    size, as HuggingFace's rotary embeddings once did."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(64, 64)
        self.register_buffer("gain", torch.rand(64) + 0.5)
        self.cached_rows = 8
        self.register_buffer("cache", torch.zeros(8, 64), persistent=False)

    def forward(self, x):
        if x.shape[0] > self.cached_rows:
            self.cached_rows, self.cache = x.shape[0], torch.ones(x.shape[0], 64)
        return self.linear(x) * self.gain + self.cache[: x.shape[0]]


def test_explain_between_a_forward_and_its_backward_writes_back_only_what_it_changed():
    """A buffer explain's run did not change keeps its version (the pending backward saved it); a cache the run
    rebuilt stays as rebuilt, beside the attribute that describes it."""
    model = _GainAndCache()
    x = torch.randn(32, 64)
    loss = model(x[:4]).sum()
    fp8graph.explain(model, x)
    loss.backward()  # autograd refuses a saved tensor whose version moved
    assert model.linear.weight.grad is not None
    assert model.cached_rows == 32 and model.cache.shape == (32, 64)
    model(x).sum().backward()
