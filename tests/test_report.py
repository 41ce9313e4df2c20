"""The explain report: rows, counts, graph code and breaks, and the HTML page in a real headless browser."""

import os
import re
import shutil
import subprocess

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
    assert code.count("fp8graph_linear_current_HYBRID_emulated(") == 8
    assert code.count("fp8graph_linear_current_E4M3_emulated(") == 6
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

    screenshot = tmp_path / "page.png"
    subprocess.run(chromium + [f"--user-data-dir={tmp_path / 'profile-png'}", "--window-size=1400,6000",
                               f"--screenshot={screenshot}", page.as_uri()],
                   capture_output=True, timeout=120, check=True)
    import matplotlib.image

    pixels = (matplotlib.image.imread(screenshot)[..., :3] * 255).round().astype(int)
    for recipe, rgb in RECIPE_RGB.items():
        matches = (pixels == torch.tensor(rgb).numpy()).all(axis=-1).sum()
        assert matches > 1000, f"{recipe} is not drawn in its colour"
