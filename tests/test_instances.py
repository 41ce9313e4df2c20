"""Every module instance runs its own decisions, wherever Dynamo compiles it (``fp8graph.instances``).

The most common FP8 policy keeps the first and last layers in high precision. On four families of 4 layers
(JetMoE, whose layers break the graph, among them) the compiled model's logits are held against an
independent oracle: the same model run eagerly, with only layers 1 and 2 replaced by each one compiled
alone with fp8graph. They must agree to fp32's rounding (the same ATen ops run on the same values; one
FP8 layer more moves the logits to 30-45 dB), each layer's decisions must be recorded, and ``explain``
must report them. Toy modules whose forward breaks the graph four ways check the same for instances held
as attributes and in a ModuleList, bit for bit, with and without gradients.
"""

import copy

import pytest
import torch

import fp8graph
from fp8graph.models.zoo import build_zoo_model, zoo_inputs
from helpers import sqnr_db

FAMILIES = ("jetmoe", "llama", "qwen3_moe", "gpt2")
# fp32 rounding differences between one graph and per-layer graphs stay far above this; one FP8 layer more
# or less moves the logits to 30-45 dB.
SAME_DB = 80.0


def _layers(model):
    """The path of the model's ModuleList of decoder layers and the list itself."""
    for path, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == 4:
            return path, module
    raise AssertionError("no list of 4 layers")


def _policy(layers_path: str):
    return fp8graph.Policy(rules=[(f"{layers_path}.0.*", None), (f"{layers_path}.3.*", None), ("lm_head", None)])


def _oracle(model, fp8_layers):
    """Logits of ``model`` run eagerly with each of ``fp8_layers`` compiled alone by fp8graph (its ``eager``
    compiler: the rewritten graph, as aot_eager computes it, without AOTAutograd's trace)."""
    oracle = copy.deepcopy(model)
    _, layers = _layers(oracle)
    for index in fp8_layers:
        layers[index] = fp8graph.compile(layers[index], compiler="eager", regions=None)
    return oracle


def _logits(run, inputs, grad: bool) -> torch.Tensor:
    with torch.set_grad_enabled(grad):
        output = run(**inputs)
        if grad:
            output.loss.backward()
    return output.logits.detach()


# Each family without gradients on the one-graph path (regions=None: where instances of a graph-broken layer
# share a frame); JetMoE, whose layers break the graph, also training with regions (the other families'
# regions are tests/regions'; the toys below train on the one-graph path).
MODES = {family: ((False, None),) for family in FAMILIES}
MODES["jetmoe"] += ((True, "auto"),)


@pytest.mark.parametrize("family", FAMILIES)
def test_first_and_last_layers_kept_in_high_precision_against_an_oracle(family):
    torch._dynamo.reset()
    model = build_zoo_model(family, torch.float32, layers=4)
    inputs = zoo_inputs(family, batch=2, sequence=8)
    layers_path, _ = _layers(model)
    policy = _policy(layers_path)
    honoured = _logits(_oracle(model, (1, 2)), inputs, grad=False)

    for grad, regions in MODES[family]:
        torch._dynamo.reset()
        compiled = fp8graph.compile(copy.deepcopy(model), policy=policy, compiler="aot_eager", regions=regions)
        logits = _logits(compiled, inputs, grad)
        where = f"{family}, grad={grad}, regions={regions}"
        assert sqnr_db(honoured, logits) > SAME_DB, where
        decided = {d.site.path: d.rewritten for d in compiled.fp8graph_backend.decisions}
        for index, fp8 in ((0, False), (1, True), (2, True), (3, False)):
            mine = {path: rewritten for path, rewritten in decided.items()
                    if path.startswith(f"{layers_path}.{index}.")}
            assert mine, f"{where}: no decision of layer {index}"
            if fp8:
                assert any(mine.values()), f"{where}: layer {index} has no FP8 site"
            else:
                assert not any(mine.values()), f"{where}: layer {index} has an FP8 site: {mine}"
        assert compiled.fp8graph_backend.unmatched_rules() == [], where

    torch._dynamo.reset()
    report = fp8graph.explain(model, **inputs, policy=policy, regions=None)
    assert report.unmatched_rules == []
    last = [r for r in report if r.path.startswith(f"{layers_path}.3.")]
    assert last and all(r.recipe is None for r in last)
    assert any(r.recipe is not None for r in report if r.path.startswith(f"{layers_path}.2."))


def _break_by_item(y):
    return y * (1 + int(y.sum().item() > 0))


def _break_by_tolist(y):
    return y * (1 + len([v for v in y[0, :2].tolist() if v > 0]))


def _break_by_print(y):
    print(end="")
    return y * 2


def _break_explicitly(y):
    torch._dynamo.graph_break()
    return y * 2


BREAKS = {"item": _break_by_item, "tolist": _break_by_tolist, "print": _break_by_print,
          "graph_break": _break_explicitly}


class _Breaking(torch.nn.Module):
    def __init__(self, breaks):
        super().__init__()
        self.proj = torch.nn.Linear(32, 32)
        self._breaks = breaks

    def forward(self, x):
        return self._breaks(self.proj(x))


class _Three(torch.nn.Module):
    """Three instances of one graph-broken module, as attributes or in a ModuleList; the middle one FP8."""

    def __init__(self, breaks, in_list: bool):
        super().__init__()
        blocks = [_Breaking(breaks) for _ in range(3)]
        if in_list:
            self.blocks = torch.nn.ModuleList(blocks)
        else:
            self.first, self.middle, self.last = blocks
        self.in_list = in_list

    def forward(self, x):
        for block in (self.blocks if self.in_list else (self.first, self.middle, self.last)):
            x = block(x)
        return x


# Every way of breaking on the one-graph path, where the frame is shared; regions once per container.
CASES = [(breaks, in_list, None) for breaks in BREAKS for in_list in (False, True)] + \
        [("item", in_list, "auto") for in_list in (False, True)]


@pytest.mark.parametrize("breaks, in_list, regions", CASES)
def test_each_instance_of_a_graph_broken_module_runs_its_own_decisions(breaks, in_list, regions):
    torch.manual_seed(0)
    model, x = _Three(BREAKS[breaks], in_list), torch.randn(4, 32)
    names = ["blocks.0", "blocks.1", "blocks.2"] if in_list else ["first", "middle", "last"]
    policy = fp8graph.Policy(rules=[(f"{names[0]}.*", None), (f"{names[2]}.*", None)])
    oracle = copy.deepcopy(model)
    middle = fp8graph.compile(getattr(oracle, "blocks")[1] if in_list else oracle.middle, compiler="eager",
                              regions=None)
    if in_list:
        oracle.blocks[1] = middle
    else:
        oracle.middle = middle
    with torch.no_grad():
        expected = oracle(x)
    for grad in (False, True):
        torch._dynamo.reset()
        compiled = fp8graph.compile(copy.deepcopy(model), policy=policy, compiler="aot_eager", regions=regions)
        with torch.set_grad_enabled(grad):
            output = compiled(x.clone().requires_grad_(grad))
        assert torch.equal(output.detach(), expected), (grad, regions)
        decided = {d.site.path: d.rewritten for d in compiled.fp8graph_backend.decisions}
        assert decided == {f"{names[0]}.proj": False, f"{names[1]}.proj": True, f"{names[2]}.proj": False}
    torch._dynamo.reset()
    report = fp8graph.explain(model, x, policy=policy, regions=regions)
    assert {r.path: r.recipe is not None for r in report} == {f"{n}.proj": n == names[1] for n in names}
