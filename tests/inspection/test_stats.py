"""FP8 numerics statistics: exact values on small tensors, collection inside compiled graphs, outputs."""

import csv
import math

import pytest
import torch

import fp8graph
from fp8graph.numerics.health import quantization_health
from fp8graph.models import build
from fp8graph.numerics.quantize import quantize, quantize_current
from fp8graph.buffers.stats import STATS_BUFFER
from fp8graph.inspection.health_plot import least_healthy
from helpers import compile_fp8, graphs_per_unit

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def test_health_by_hand_e4m3():
    x = torch.tensor([0.0, 1e-4, 2.0, 1000.0])
    scale = torch.tensor(1.0)
    x_fp8 = quantize(x, scale, E4M3)  # -> [0, 0, 2, 448]: 1e-4 is below half the smallest subnormal
    amax, used_scale, underflow, overflow, sqnr = quantization_health(x, x_fp8, scale, E4M3).tolist()
    assert (amax, used_scale) == (1000.0, 1.0)
    assert underflow == torch.tensor(1 / 3).item()  # exactly 1 of the 3 non-zero values (in fp32)
    assert overflow == 0.25                             # 1000 > 464: 1 of 4 values saturated
    expected_sqnr = 10 * math.log10((1e-8 + 4 + 1e6) / (1e-8 + (1000 - 448) ** 2))
    assert sqnr == pytest.approx(expected_sqnr, rel=1e-5)


def test_health_by_hand_e5m2_and_the_rounding_band_above_max():
    x = torch.tensor([60000.0, 62000.0, -1.0, 3.0])
    scale = torch.tensor(1.0)
    x_fp8 = quantize(x, scale, E5M2)  # 60000 rounds to 57344 anyway; 62000 is clipped
    _, _, underflow, overflow, _ = quantization_health(x, x_fp8, scale, E5M2).tolist()
    assert underflow == 0.0
    assert overflow == 0.25


def test_exact_cast_has_infinite_sqnr():
    x = torch.tensor([1.0, -2.0, 0.5, 0.0])
    x_fp8, scale = quantize_current(x, E4M3, power_2_scales=True)
    health = quantization_health(x, x_fp8, scale, E4M3).tolist()
    assert health[2:4] == [0.0, 0.0] and health[4] == float("inf")


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_input_is_never_called_a_good_cast(bad):
    x = torch.randn(64) * 1e-3
    x[3] = bad
    x_fp8, scale = quantize_current(x, E4M3)
    health = quantization_health(x, x_fp8, scale, E4M3).tolist()
    assert math.isnan(health[4])  # an SQNR of NaN ranks worst in the tables and plots
    assert health[1] == pytest.approx(448 / x[x.isfinite()].abs().max().item(), rel=1e-6)  # the finite values' scale


def test_a_row_cast_records_the_scale_of_the_row_holding_the_amax_whatever_rows_are_zero():
    """An all-zero row (the gradient of a token whose loss is ignored) has the fallback scale 1, below the others:
    the recorded scale is still that of the row holding the amax, as documented."""
    from fp8graph.numerics.tiles import ScaleKind, Tiling, expand_scale, reference_quantize_tiles

    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(0))
    x[5] = 0.0
    tiling = Tiling(1, None, ScaleKind.POWER_2)
    x_fp8, scale = reference_quantize_tiles(x, tiling)
    recorded = quantization_health(x, x_fp8, expand_scale(scale, tiling, x_fp8.shape), E4M3)[1].item()
    assert scale[5].item() == 1.0 and recorded == scale[x.abs().amax(dim=1).argmax()].item() > 1.0


def test_overflow_is_a_fraction_of_the_finite_values():
    x = torch.tensor([1000.0, 1.0, float("nan"), float("inf")])
    scale = torch.tensor(1.0)
    assert quantization_health(x, quantize(x, scale, E4M3), scale, E4M3)[3].item() == 0.5


def test_an_empty_cast_lost_nothing():
    x = torch.empty(0, 16)
    health = quantization_health(x, x.to(E4M3), torch.tensor(4.0), E4M3).tolist()
    assert health == [0.0, 4.0, 0.0, 0.0, float("inf")]


def test_the_health_of_extreme_magnitudes_is_the_health_of_their_shape():
    """SQNR is scale-invariant; 2**100 casts as well as 1 (its squares overflow fp32, the measure must not).
    Powers of two: the scaled tensors, and so their casts, are the same bits."""
    x = torch.randn(4096, generator=torch.Generator().manual_seed(0))
    by_magnitude = {}
    for magnitude in (2.0 ** -100, 1.0, 2.0 ** 100):
        x_fp8, scale = quantize_current(x * magnitude, E4M3, power_2_scales=True)
        by_magnitude[magnitude] = quantization_health(x * magnitude, x_fp8, scale, E4M3)[4].item()
    assert by_magnitude[2.0 ** 100] == pytest.approx(by_magnitude[1.0], abs=1e-3) and by_magnitude[1.0] > 25
    assert by_magnitude[2.0 ** -100] == pytest.approx(by_magnitude[1.0], abs=1e-3)


def test_a_nan_input_in_a_compiled_model_is_named_least_healthy():
    model = build("mlp", "tiny")
    compiled = fp8graph.compile(model, compiler="aot_eager", stats=True)
    x = torch.randn(32, 64)
    x[0, 0] = float("nan")
    compiled(x)
    rows = {(r.path, r.role): r for r in compiled.fp8graph_stats.record(step=0)}
    assert math.isnan(rows["up", "input"].sqnr_db) and rows["up", "weight"].sqnr_db > 25
    # NaN carries on into the next site's input, as in fp32; both rank worst, ahead of any finite SQNR.
    assert set(least_healthy(rows.values(), "input", "sqnr_db", 2, higher_is_worse=False)) == {"up", "mid"}


def _mlp_stats(compiler):
    model = build("mlp", "tiny")
    x = torch.randn(32, 64)
    compiled = fp8graph.compile(model, compiler=compiler, stats=True)
    compiled(x).sum().backward()
    return model, x, compiled.fp8graph_stats.record(step=0)


@pytest.mark.parametrize("compiler", ["aot_eager", pytest.param("inductor", marks=pytest.mark.inductor)])
def test_collected_inside_the_graph_equal_the_eager_values(compiler):
    model, x, rows = _mlp_stats(compiler)
    _, _, eager_rows = _mlp_stats("eager")
    assert [(r.path, r.role) for r in rows] == [
        (path, role) for path in ("up", "mid") for role in ("input", "weight", "grad_output")]
    by_key = {(r.path, r.role): r for r in rows}
    assert by_key["up", "input"].amax == pytest.approx(x.abs().max().item(), rel=1e-6)
    assert by_key["up", "weight"].amax == pytest.approx(model.up.weight.abs().max().item(), rel=1e-6)
    input_fp8, input_scale = quantize_current(x, E4M3)
    expected = quantization_health(x, input_fp8, input_scale, E4M3).tolist()
    got = by_key["up", "input"]
    assert [got.amax, got.scale, got.underflow, got.overflow] == pytest.approx(expected[:4], rel=1e-6)
    assert got.sqnr_db == pytest.approx(expected[4], abs=1e-3)
    for eager_row, row in zip(eager_rows, rows):
        assert row.sqnr_db == pytest.approx(eager_row.sqnr_db, abs=0.05)
        assert row.amax == pytest.approx(eager_row.amax, rel=1e-5)


def test_llama_stats_in_one_graph_and_no_grad_rows_without_gradients():
    model = build("llama", "tiny")
    compiled = fp8graph.compile(model, compiler="aot_eager", stats=True)
    tokens = torch.randint(0, 250, (2, 16))
    compiled(tokens, labels=tokens).loss.backward()
    rows = compiled.fp8graph_stats.record(step=0)
    assert set(graphs_per_unit(compiled.fp8graph_backend)) == {1}  # no graph break for the stats
    assert len(rows) == 14 * 3
    assert all(r.sqnr_db > 20 and r.underflow < 0.05 for r in rows if r.role != "grad_output")
    with torch.no_grad():
        compiled(tokens)
    assert {r.role for r in compiled.fp8graph_stats.record(step=1)} == {"input", "weight"}
    assert compiled.fp8graph_stats.record(step=2) == []  # nothing new since the last record


class _TwoLinearsWithABreak(torch.nn.Module):
    """linear -> graph break -> linear: two compiled graphs, each with its own backward."""

    def __init__(self):
        super().__init__()
        self.first, self.second = torch.nn.Linear(32, 32), torch.nn.Linear(32, 32)

    def forward(self, x):
        x = self.first(x)
        torch._dynamo.graph_break()
        return self.second(x)


def test_stats_across_graph_breaks_record_every_site_and_role():
    # One buffer shared by both graphs would be written by the second forward
    # after the first graph saved it for its backward: autograd refuses that.
    model = _TwoLinearsWithABreak()
    compiled = fp8graph.compile(model, compiler="aot_eager", stats=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    for step in range(2):
        compiled(torch.randn(16, 32)).sum().backward()
        optimizer.step()  # the next call casts the changed weights: the same graphs
        rows = compiled.fp8graph_stats.record(step)
        assert [(r.path, r.role) for r in rows] == [
            (path, role) for path in ("first", "second") for role in ("input", "weight", "grad_output")]
    assert compiled.fp8graph_backend.graph_count == 2


def test_stats_off_adds_nothing():
    model = build("mlp", "tiny")
    compiled, backend = compile_fp8(model, cache_weights=False)  # the weight copies' hooks are not stats'
    compiled(torch.randn(4, 64))
    assert not hasattr(model, STATS_BUFFER)
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())
    assert not any(hasattr(m, STATS_BUFFER) for m in model.modules())
    [gm] = backend.graph_modules
    fp8_nodes = [n for n in gm.graph.nodes if getattr(n.target, "__name__", "").startswith("fp8graph_")]
    assert len(fp8_nodes) == 2 and all(len(n.args) == 3 for n in fp8_nodes)
    torch._dynamo.reset()
    compiled_plain = fp8graph.compile(model, policy=fp8graph.Policy(default=None), compiler="aot_eager")
    compiled_plain(torch.randn(4, 64))
    [plain_gm] = compiled_plain.fp8graph_backend.graph_modules
    assert len(gm.graph.nodes) == len(plain_gm.graph.nodes)  # 1:1 replacement, no extra node


def test_csv_tensorboard_and_plot(tmp_path):
    model = build("mlp", "tiny")
    compiled = fp8graph.compile(model, compiler="aot_eager", stats=True)
    stats = compiled.fp8graph_stats
    for step in range(3):
        compiled(torch.randn(16, 64) * (step + 1)).sum().backward()
        stats.record(step)
    with open(stats.to_csv(tmp_path / "stats.csv")) as file:
        rows = list(csv.DictReader(file))
    assert len(rows) == 3 * 6 and rows[0].keys() >= {"step", "path", "role", "sqnr_db", "underflow"}
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(stats.to_tensorboard(tmp_path / "tb")))
    accumulator.Reload()
    scalars = accumulator.Tags()["scalars"]
    assert "fp8/sqnr_db/up/input" in scalars
    assert [e.step for e in accumulator.Scalars("fp8/amax/mid/grad_output")] == [0, 1, 2]
    assert stats.plot(tmp_path / "health.png").stat().st_size > 10_000
    assert "fp8graph stats, step 2" in str(stats)


def _rows(final_sqnr: dict[str, float], final_underflow: dict[str, float]) -> list:
    from fp8graph.inspection.stats import StatsRow

    rows = []
    for path in final_sqnr:
        rows.append(StatsRow(0, path, "input", 1.0, 1.0, 0.0, 0.0, 30.0))
        rows.append(StatsRow(1, path, "input", 1.0, 1.0, final_underflow[path], 0.0, final_sqnr[path]))
        rows.append(StatsRow(1, path, "weight", 1.0, 1.0, 0.9, 0.0, -5.0))  # another role: ignored
    return rows


def test_health_figure_names_the_least_healthy_sites_and_greys_the_rest():
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.colors import to_hex

    from fp8graph.inspection.health_plot import health_figure, least_healthy

    sqnr = {f"layers.{i}.proj": 30.0 + i for i in range(12)}
    sqnr["layers.7.proj"] = 9.0
    sqnr["layers.3.proj"] = float("nan")   # a broken cast ranks worst
    sqnr["layers.5.proj"] = float("inf")   # an exact one best
    underflow = {path: 0.001 for path in sqnr}
    underflow["layers.11.proj"] = 0.2
    sqnr["layers.9.k"] = sqnr["layers.9.q"] = 10.0  # one shared input: one line, one label
    underflow["layers.9.k"] = underflow["layers.9.q"] = 0.001
    rows = _rows(sqnr, underflow)
    assert least_healthy(rows, "input", "sqnr_db", 4, higher_is_worse=False) == [
        "layers.3.proj", "layers.7.proj", "layers.9.{k,q}", "layers.0.proj"]
    assert least_healthy(rows, "input", "underflow", 1, higher_is_worse=True) == ["layers.11.proj"]

    figure = health_figure(rows, role="input", highlight=4)
    sqnr_axis, underflow_axis = figure.axes
    named = [line.get_label() for line in sqnr_axis.get_lines() if not line.get_label().startswith("_")]
    assert named == ["layers.3.proj (nan)", "layers.7.proj (9)", "layers.9.{k,q} (10)", "layers.0.proj (30)"]
    grey = [line for line in sqnr_axis.get_lines() if to_hex(line.get_color()) == "#b8b8b8"]
    assert len(grey) == 12 - 3 and all(line.get_label().startswith("_") for line in grey)
    assert [t.get_text() for t in sqnr_axis.get_legend().get_texts()] == named
    assert "9 other sites in grey" in sqnr_axis.get_legend().get_title().get_text()
    assert underflow_axis.get_legend().get_texts()[0].get_text() == "layers.11.proj (20)"

    # Equal numbers are not one tensor: sites of two modules stay apart; a perfect value is never "worst".
    unrelated = _rows({"a.proj": 20.0, "b.proj": 20.0, "c.proj": 25.0}, {"a.proj": 0.0, "b.proj": 0.0, "c.proj": 0.0})
    assert least_healthy(unrelated, "input", "sqnr_db", 2, higher_is_worse=False) == ["a.proj", "b.proj"]
    assert least_healthy(unrelated, "input", "underflow", 2, higher_is_worse=True) == []
    # A site recorded once is a marker, not an invisible one-point line.
    once = [row for row in unrelated if row.step == 1]
    [first_line, *_] = health_figure(once, role="input", highlight=1).axes[0].get_lines()
    assert first_line.get_marker() == "o" and len(first_line.get_xdata()) == 1


def test_stats_need_a_module():
    with pytest.raises(ValueError, match="stats=True needs an nn.Module"):
        fp8graph.compile(lambda x: x, stats=True)


@pytest.mark.parametrize("options", [dict(stats=True), dict(policy=fp8graph.DelayedScaling())],
                         ids=["stats", "delayed"])
def test_a_bare_module_keeps_its_stats_and_state_on_itself(options):
    """A model that is one Linear: fp8graph.compile traces the module's own hooks into the graph."""
    linear = torch.nn.Linear(32, 32)
    compiled = fp8graph.compile(linear, compiler="aot_eager", **options)
    compiled(torch.randn(16, 32)).sum().backward()
    assert [d.rewritten for d in compiled.fp8graph_backend.decisions] == [True]
    if "stats" in options:
        assert [(r.path, r.role) for r in compiled.fp8graph_stats.record(0)] == [
            ("", "input"), ("", "weight"), ("", "grad_output")]
    else:
        assert linear.fp8graph_amax_history_weight[:, 0].tolist() != [0.0, 0.0, 0.0]  # recorded this step


def test_weight_caching_of_a_bare_module_is_refused_with_the_way_out():
    with pytest.raises(ValueError, match="cache_weights=True needs a model with submodules.*torch.nn.Sequential"):
        fp8graph.compile(torch.nn.Linear(32, 32), cache_weights=True)


def test_bare_backend_refuses_stats_with_a_pointer_to_compile():
    with pytest.raises(Exception, match=r"stats need fp8graph.compile\(model, stats=True\)"):
        torch.compile(build("mlp", "tiny"), backend="fp8", options={"stats": True})(torch.randn(2, 64))


def test_sampling_stats_every_few_steps_with_a_second_compile():
    model = build("llama", "tiny")
    fast = fp8graph.compile(model, compiler="aot_eager")
    with_stats = fp8graph.compile(model, compiler="aot_eager", stats=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, 250, (2, 16))
    recorded = []
    for step in range(6):
        sample = step % 3 == 0
        (with_stats if sample else fast)(tokens, labels=tokens).loss.backward()
        optimizer.step()  # every call casts the changed weights: one graph, filling their copies
        recorded.append(len(with_stats.fp8graph_stats.record(step)))
    assert recorded == [42, 0, 0, 42, 0, 0]  # the fast graph writes nothing
    assert set(graphs_per_unit(fast.fp8graph_backend)) == set(graphs_per_unit(with_stats.fp8graph_backend)) == {1}


def test_removed_stats_leave_a_model_that_trains_as_without_them_and_compiles_with_them_again():
    """``remove()`` dropped the buffers, but the next call's recompile still asked for them (AttributeError), and
    a new ``stats=True`` compile was refused as if another model held them."""
    torch.manual_seed(0)
    model, x = build("mlp", "tiny"), torch.randn(8, 64)
    reference = fp8graph.compile(build("mlp", "tiny"), compiler="aot_eager")
    reference.load_state_dict(model.state_dict())
    compiled = fp8graph.compile(model, compiler="aot_eager", stats=True)
    compiled(x).sum().backward()
    assert compiled.fp8graph_stats.record(0)
    compiled.fp8graph_stats.remove()
    compiled.fp8graph_stats.remove()  # twice: nothing left to remove
    assert not any(name.endswith(STATS_BUFFER) for name, _ in model.named_buffers())
    assert torch.equal(compiled(x), reference(x))
    with pytest.raises(RuntimeError, match=r"removed from the model \(remove\(\)\)"):
        compiled.fp8graph_stats.record(1)
    again = fp8graph.compile(model, compiler="aot_eager", stats=True)
    again(x).sum().backward()
    assert again.fp8graph_stats.record(2)


class _ReachableByTwoPaths(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(32, 32)
        self.b = self.a  # one module, two names; named_modules() calls it "a"

    def forward(self, x):
        return self.b(x)


def test_a_module_reachable_by_two_paths_reports_under_its_first_name():
    compiled = fp8graph.compile(_ReachableByTwoPaths(), compiler="aot_eager", stats=True,
                                policy=fp8graph.DelayedScaling())
    compiled(torch.randn(16, 32)).sum().backward()
    assert [d.site.path for d in compiled.fp8graph_backend.decisions] == ["a"]
    assert [(r.path, r.role) for r in compiled.fp8graph_stats.record(0)] == [
        ("a", role) for role in ("input", "weight", "grad_output")]


class _CalledTwice(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = torch.nn.Module()
        self.inner.square = torch.nn.Linear(32, 32, bias=False)

    def forward(self, x):
        return self.inner.square(torch.relu(self.inner.square(x)) * 4)


def test_a_module_called_twice_reports_its_last_call_in_every_row():
    """Forward rows come from the last call to run forward; grad_output too, though its backward runs first."""
    model, x = _CalledTwice(), torch.randn(16, 32)
    grad = torch.randn(16, 32)
    calls = []
    hook = model.inner.square.register_forward_hook(lambda module, args, output: calls.append(
        (args[0].detach(), output)) or output.retain_grad())
    (model(x) * grad).sum().backward()
    hook.remove()
    (first_input, first_output), (last_input, last_output) = calls
    assert first_output.grad.abs().max().item() != pytest.approx(last_output.grad.abs().max().item(), rel=0.2)  # rows that differ

    compiled = fp8graph.compile(model, compiler="aot_eager", stats=True)
    (compiled(x) * grad).sum().backward()
    rows = {r.role: r for r in compiled.fp8graph_stats.record(0) if r.path == "inner.square"}
    assert rows["input"].amax == pytest.approx(last_input.abs().max().item(), rel=0.1)
    assert rows["grad_output"].amax == pytest.approx(grad.abs().max().item(), rel=1e-6)  # the last call's output grad
