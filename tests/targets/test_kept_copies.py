"""The post-grad pass that lets a fill write the weights' FP8 copies where it casts them
(``fp8graph.targets.kept_copies``): which ``copy_`` it moves, and that the moved graph computes the same."""

import operator

import torch
import torch.fx

from fp8graph.targets.kept_copies import KeptCopiesWrittenWhereCast

aten = torch.ops.aten
FP8 = torch.float8_e4m3fn


def _graph(copy_layout: bool, old_contents_read: bool) -> torch.fx.GraphModule:
    """``cast = w.to(fp8)`` (transposed when ``copy_layout``: a copy laid out as the buffer, as AOTAutograd writes
    one), a reader of the cast, and ``copy_(buffer, cast)`` at the end, as AOTAutograd leaves an input's
    mutation; ``old_contents_read`` adds a reader of the buffer's old contents."""
    graph = torch.fx.Graph()
    buffer, weight = graph.placeholder("buffer"), graph.placeholder("weight")
    buffer.meta["val"] = torch.empty(4, 8, dtype=FP8)
    weight.meta["val"] = torch.empty(8, 4) if copy_layout else torch.empty(4, 8)
    cast = graph.call_function(torch.ops.prims.convert_element_type.default, (weight, FP8))
    value = cast
    if copy_layout:
        value = graph.call_function(aten.permute.default, (cast, [1, 0]))
        value.meta["val"] = torch.empty(4, 8, dtype=FP8)
        value = graph.call_function(aten.copy.default, (buffer, value))
    cast.meta["val"] = torch.empty(tuple(weight.meta["val"].shape), dtype=FP8)
    value.meta.setdefault("val", torch.empty(4, 8, dtype=FP8))
    read = graph.call_function(aten._to_copy.default, (value,), {"dtype": torch.float32})
    outputs = [graph.call_function(aten.mul.Tensor, (read, 2.0))]
    if old_contents_read:
        outputs.append(graph.call_function(aten._to_copy.default, (buffer,), {"dtype": torch.float32}))
    graph.call_function(aten.copy_.default, (buffer, value))
    graph.output(tuple(outputs))
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def _run(module: torch.fx.GraphModule, copy_layout: bool):
    torch.manual_seed(0)
    weight = torch.randn(8, 4) if copy_layout else torch.randn(4, 8)
    buffer = torch.full((4, 8), 3.0).to(FP8)
    outputs = module(buffer, weight)
    return [o.clone() for o in outputs], buffer.float()


def _copies(module):
    return [node for node in module.graph.nodes if node.target is aten.copy_.default]


def test_the_copy_moves_to_the_cast_and_its_readers_read_the_buffer():
    for copy_layout in (False, True):
        module = _graph(copy_layout, old_contents_read=False)
        expected = _run(module, copy_layout)
        KeptCopiesWrittenWhereCast()(module.graph)
        module.recompile()
        (copy,) = _copies(module)
        source = copy.args[1]
        assert copy.prev is source, "written right after what it copies"
        assert source.target is (aten.permute.default if copy_layout else torch.ops.prims.convert_element_type.default)
        assert not [n for n in module.graph.nodes if n.target is aten.copy.default], "the layout copy is gone"
        reader = next(n for n in module.graph.nodes if n.target is aten._to_copy.default)
        assert reader.args[0] is copy
        got = _run(module, copy_layout)
        assert all(torch.equal(a, b) for a, b in zip(got[0], expected[0])) and torch.equal(got[1], expected[1])


def test_a_buffer_whose_old_contents_are_read_or_a_wide_buffer_is_left_alone():
    module = _graph(copy_layout=False, old_contents_read=True)
    before = [(n.name, n.args) for n in module.graph.nodes]
    KeptCopiesWrittenWhereCast()(module.graph)
    assert [(n.name, n.args) for n in module.graph.nodes] == before
    module = _graph(copy_layout=False, old_contents_read=False)
    module.graph.find_nodes(op="placeholder")[0].meta["val"] = torch.empty(4, 8, dtype=torch.bfloat16)
    before = [(n.name, n.args) for n in module.graph.nodes]
    KeptCopiesWrittenWhereCast()(module.graph)
    assert [(n.name, n.args) for n in module.graph.nodes] == before, "only FP8 copies"


def test_the_pass_composes_with_a_users_pass_and_keys_inductors_cache_by_both():
    from torch._inductor.custom_graph_pass import CustomGraphPass

    from fp8graph.targets.kept_copies import post_grad_post_pass

    class UsersPass(CustomGraphPass):
        calls = []

        def __call__(self, graph):
            self.calls.append(graph)

        def uuid(self):
            return "users-pass"

    composed = post_grad_post_pass(UsersPass())
    module = _graph(copy_layout=False, old_contents_read=False)
    composed(module.graph)
    assert UsersPass.calls == [module.graph] and composed.uuid().endswith("users-pass")
    plain = lambda graph: None  # noqa: E731 - a function Inductor's cache cannot key is left as it is
    assert post_grad_post_pass(plain) is plain
    assert operator.ne(post_grad_post_pass(None).uuid(), composed.uuid())
