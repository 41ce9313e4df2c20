"""No spelling of a Python operator on tensors stops the compile.

An operator reaches Dynamo's graph in three spellings, and the side-effect analysis
(``fp8graph.passes.side_effects``) reads each differently::

    h.__eq__(m), m.__iand__(k), h.__rpow__(2.0)    call_method __eq__, ...     every dunder torch.Tensor defines
    h == m, m &= k, 2.0 ** h                        call_function operator.eq   Python's operators
    torch.eq(h, m), m.bitwise_and_(k)               call_function torch.eq      the plain torch functions

(``h.__eq__`` once crashed it: ``torch.ops.aten.__eq__`` is the namespace object's own comparison, not an
ATen op.) Each case runs one op between two linears::

    x -> proj -> h -> op -> back to h's dtype -> out -> y

a bitwise op on masks compared from ``h``, a shift on small integers made from ``h``, an in-place op on a
fresh tensor, its result left unread. Every site kept in high precision, fp8graph's outputs and gradients
equal plain ``torch.compile``'s bit for bit, in fp32 and BF16; with the default FP8 policy it compiles and
runs. All the cases share one model per dtype, their results stacked into one ``out``: one compile per
dtype and policy, not one per case (about 30 s for the file instead of minutes). Where that compile fails,
each case compiles alone, so the failure names the op.
"""

import copy
import dataclasses
import functools
import operator

import pytest
import torch
import torch.fx
from torch import nn

import fp8graph
from fp8graph.passes import side_effects
from fp8graph.passes.side_effects import UNKNOWN, effects_of, has_side_effects
from helpers import compile_fp8, fp8_target_count, graphs_per_unit, sqnr_db

K = N = 32
ROWS = 8
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclasses.dataclass(frozen=True)
class Op:
    """One operator: its dunder's stem (``add`` for ``__add__``, ``__radd__``, ``__iadd__``), what it takes, its
    Python syntax (None for Python 2's ``__div__``) and its torch function; its reflected and in-place dunders
    are those torch.Tensor defines."""

    stem: str
    operands: str  # "float", "compare", "matrix", "mask", "int", "unary", "unary mask"
    symbol: str | None
    torch_function: str


OPS = (
    *(Op(stem, "compare", symbol, stem) for stem, symbol in (("eq", "=="), ("ne", "!="), ("lt", "<"), ("le", "<="),
                                                             ("gt", ">"), ("ge", ">="))),
    Op("add", "float", "+", "add"), Op("sub", "float", "-", "sub"), Op("mul", "float", "*", "mul"),
    Op("truediv", "float", "/", "true_divide"), Op("div", "float", None, "div"),
    Op("floordiv", "float", "//", "floor_divide"), Op("mod", "float", "%", "remainder"),
    Op("pow", "float", "**", "pow"), Op("matmul", "matrix", "@", "matmul"),
    Op("and", "mask", "&", "bitwise_and"), Op("or", "mask", "|", "bitwise_or"), Op("xor", "mask", "^", "bitwise_xor"),
    Op("lshift", "int", "<<", "bitwise_left_shift"), Op("rshift", "int", ">>", "bitwise_right_shift"),
    Op("neg", "unary", "-", "neg"), Op("pos", "unary", "+", "positive"), Op("abs", "unary", "abs", "abs"),
    Op("invert", "unary mask", "~", "bitwise_not"),
)

# The dunders torch.Tensor defines that are no operator on tensors, each with why it is not compiled here. A
# dunder a new torch adds is in neither list, and test_every_dunder_of_torch_tensor_is_tested_or_skipped fails.
SKIPPED = {
    **dict.fromkeys(("__bool__", "__nonzero__", "__float__", "__int__", "__long__", "__index__", "__complex__"),
                    "converts to a Python number: data-dependent, a graph break, no op in the graph"),
    "__contains__": "returns a Python bool: data-dependent, a graph break",
    "__len__": "returns the size of the first dimension, a Python int: no op in the graph",
    "__iter__": "Dynamo unrolls iteration into __getitem__ calls (tested)",
    "__delitem__": "a tensor does not support deleting items: eager raises TypeError",
    **dict.fromkeys(("__array__", "__array_priority__", "__array_wrap__", "__cuda_array_interface__",
                     "__dlpack__", "__dlpack_device__", "__dlpack_c_exchange_api__"),
                    "interchange with NumPy, CUDA and DLPack: not traced into graphs"),
    **dict.fromkeys(("__torch_function__", "__torch_dispatch__"), "torch's overriding protocols, not operators"),
    **dict.fromkeys(("__class__", "__delattr__", "__dir__", "__doc__", "__format__", "__getattribute__",
                     "__getstate__", "__hash__", "__init__", "__init_subclass__", "__new__", "__reduce__",
                     "__reduce_ex__", "__repr__", "__setattr__", "__setstate__", "__sizeof__", "__str__",
                     "__subclasshook__", "__deepcopy__", "__module__", "__dict__", "__weakref__",
                     "__annotations__"),
                    "Python's object protocol (construction, attributes, printing, pickling, copying)"),
}


def _tensor_dunders() -> set[str]:
    """The dunder attributes of torch.Tensor, less ``__slotnames__``: copyreg's cache of the class's slot names,
    there only once some tensor has been pickled in the process (no method)."""
    return {name for name in dir(torch.Tensor) if name.startswith("__") and name.endswith("__")} - {"__slotnames__"}


def _operands(op: Op, h: torch.Tensor, reflected: bool):
    """``(self, others)`` for ``op``: fresh tensors made from ``h`` (an in-place op may write them); a reflected
    op gets a Python number as its other operand, as in ``2.0 - h``, where Python asks h for ``__rsub__``."""
    if op.operands in ("mask", "unary mask"):
        first, other = h > 0, h < 0.5
        number = True
    elif op.operands == "int":
        first, other = (h > 0).to(torch.int32) + 1, (h < 0.5).to(torch.int32) + 1  # shifts by 1 or 2
        number = 1
    elif op.operands == "compare":
        first, other, number = h, h.flip(-1), None
    elif op.operands == "matrix":
        first, other = h, torch.full((N, N), 1 / N, dtype=h.dtype)
        number = torch.full((ROWS, ROWS), 1 / ROWS, dtype=h.dtype)  # a reflected matmul's other: a tensor
    else:
        first, other, number = h, 2.0, 2.0
    if op.operands.startswith("unary"):
        return first, ()
    return first, ((number if reflected else other),)


def _back_to_float(h: torch.Tensor, result: torch.Tensor) -> torch.Tensor:
    """A mask picks h or -h, integers scale h, a float is h's: each case's output feeds the second linear."""
    if result.dtype == torch.bool:
        return torch.where(result, h, -h)
    if not result.is_floating_point():
        return h * result.to(h.dtype)
    return result


def _case(op: Op, call, reflected=False, in_place=False, differentiable=True):
    """The case of one spelling: ``call(self, *others)`` on ``op``'s operands, its result back in h's dtype; an
    in-place call's result is left unread, the written tensor is what the case returns."""

    def run(h):
        first, others = _operands(op, h.detach() if not differentiable else h, reflected)
        if in_place:
            first = first.clone()
            call(first, *others)
            result = first
        else:
            result = call(first, *others)
        if not differentiable:
            return h * result
        return _back_to_float(h, result)

    return run


def _spellings() -> dict:
    """Every spelling's case, by name: ``Tensor.__radd__``, ``h += other``, ``number - h``, ``torch.add``,
    ``Tensor.add_``."""
    cases = {}
    dunders = _tensor_dunders()

    def add(name, op, call, reflected=False, in_place=False):
        # Autograd has no derivative for floor_divide, nor for the remainder of a number by a tensor.
        differentiable = op.stem != "floordiv" and not (op.stem == "mod" and reflected)
        cases[name] = _case(op, call, reflected, in_place, differentiable)

    for op in OPS:
        unary = op.operands.startswith("unary")
        for dunder, reflected, in_place in ((f"__{op.stem}__", False, False), (f"__r{op.stem}__", True, False),
                                            (f"__i{op.stem}__", False, True)):
            if dunder in dunders:
                add(f"Tensor.{dunder}", op, functools.partial(_call_method, dunder), reflected, in_place)
            if dunder in dunders and op.symbol is not None:
                syntax = ("abs(h)" if op.symbol == "abs" else f"{op.symbol}h") if unary else \
                    f"number {op.symbol} h" if reflected else f"h {op.symbol}{'=' if in_place else ''} other"
                add(syntax, op, _python(syntax if in_place else f"return {syntax}"), reflected, in_place)
        add(f"torch.{op.torch_function}", op, getattr(torch, op.torch_function))
        if op.operands in ("float", "mask", "int"):
            in_place_method = f"{op.torch_function}_"
            add(f"Tensor.{in_place_method}", op, functools.partial(_call_method, in_place_method), in_place=True)
    # Subscription (x[i], x[i] = v) and reversed(x), each spelling written out.
    subscript = Op("getitem", "float", None, "index_select")
    for name, statement, in_place in (
            ("Tensor.__getitem__", "return h.__getitem__((..., torch.arange(N - 1, -1, -1)))", False),
            ("h[..., columns]", "return h[..., torch.arange(N - 1, -1, -1)]", False),
            ("torch.index_select", "return torch.index_select(h, -1, torch.arange(N - 1, -1, -1))", False),
            ("Tensor.__setitem__", "h.__setitem__(h > 0.5, 0.0)", True),
            ("h[mask] = 0.0", "h[h > 0.5] = 0.0", True),
            ("Tensor.masked_fill_", "h.masked_fill_(h > 0.5, 0.0)", True),
            ("Tensor.__reversed__", "return h.__reversed__()", False),
            ("torch.flip", "return torch.flip(h, (0,))", False)):
        add(name, subscript, _python(statement), in_place=in_place)
    return cases


def _call_method(name, first, *others):
    return getattr(first, name)(*others)


def _python(statement: str):
    """A function of ``h`` and ``other`` whose body is ``statement``: Python's syntax as a user writes it, which
    Dynamo reads from the bytecode (``h == other`` is a COMPARE_OP, ``h &= other`` a BINARY_OP; Dynamo traces
    ``h[mask] = 0.0`` but not an explicit ``operator.setitem`` call)."""
    namespace = {"torch": torch, "N": N}
    exec(f"def spelled(h, other=None):\n    number = other\n    {statement}", namespace)
    return namespace["spelled"]


CASES = _spellings()
TESTED = {name.split(".")[1] for name in CASES if name.startswith("Tensor.__")}
IN_PLACE = {f"__i{op.stem}__" for op in OPS} & TESTED | {"__setitem__"}


class Spellings(nn.Module):
    """Every case side by side on one input, between the same two linears (two sites, however many cases)::

        x -> proj -> h -> each case -> stacked -> out -> y[case]
    """

    def __init__(self, names):
        super().__init__()
        self.proj = nn.Linear(K, N)
        self.out = nn.Linear(N, K)
        self.names = tuple(names)

    def forward(self, x):
        h = self.proj(x)
        return self.out(torch.stack([CASES[name](h) for name in self.names]))


def _outputs_and_gradients(run, model, x, names, each_case_alone=True):
    """Each case's output, and the parameters' gradients: of the case's loss alone (so that a mismatch names
    the case, and no other case's gradient is summed with it in an order a pass may change), or of all."""
    stacked = run(x)
    parameters = list(model.parameters())
    if not each_case_alone:
        gradients = torch.autograd.grad(stacked.float().square().mean(), parameters)
        return {name: (stacked[i].detach(), gradients) for i, name in enumerate(names)}
    result = {}
    for i, name in enumerate(names):
        gradients = torch.autograd.grad(stacked[i].float().square().mean(), parameters, retain_graph=True)
        result[name] = (stacked[i].detach(), gradients)
    return result


def _compile_and_run(names, dtype, policy):
    """``(plain, fp8graph, fp8 sites)`` for the cases ``names``: plain ``torch.compile``'s outputs and
    gradients, fp8graph's, and the FP8 sites fp8graph compiled; plain is None for the FP8 policy, whose
    gradients are of all the cases' loss (each alone, a backward through FP8's emulation per case, is slow)."""
    torch.manual_seed(0)
    model = Spellings(names).to(dtype)
    x = torch.randn(ROWS, K, dtype=dtype)
    plain = None
    if policy == "kept":
        plain_model = copy.deepcopy(model)
        torch._dynamo.reset()
        compiled = torch.compile(plain_model, backend="aot_eager", fullgraph=True)
        plain = _outputs_and_gradients(compiled, plain_model, x, names)
    torch._dynamo.reset()
    kept = {"policy": fp8graph.Policy(default=None)} if policy == "kept" else {}
    compiled, backend = compile_fp8(model, fullgraph=True, **kept)
    actual = _outputs_and_gradients(compiled, model, x, names, each_case_alone=policy == "kept")
    assert graphs_per_unit(backend) == [1]
    return plain, actual, sum(fp8_target_count(gm) for gm in backend.graph_modules)


@functools.cache
def _all_cases(dtype_name, policy):
    """All cases compiled as one model: the result of :func:`_compile_and_run`, or the exception it raised."""
    try:
        return _compile_and_run(tuple(CASES), DTYPES[dtype_name], policy)
    except Exception as error:  # each case then compiles alone, and the one that fails names itself
        return error


def _case_run(name, dtype_name, policy):
    """``(plain, fp8graph)`` outputs and gradients of case ``name``, from the shared compile where it worked."""
    shared = _all_cases(dtype_name, policy)
    if isinstance(shared, Exception):
        plain, actual, _ = _compile_and_run((name,), DTYPES[dtype_name], policy)
    else:
        plain, actual, _ = shared
    return (plain[name] if plain else None), actual[name]


def test_every_dunder_of_torch_tensor_is_tested_or_skipped():
    assert not TESTED & set(SKIPPED)
    assert _tensor_dunders() == TESTED | set(SKIPPED), "a dunder in neither TESTED nor SKIPPED, or gone from torch"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_kept_sites_equal_plain_torch_compile_bit_for_bit(case, dtype):
    (expected, expected_gradients), (actual, gradients) = _case_run(case, dtype, "kept")
    assert torch.equal(actual, expected)
    for gradient, expected_gradient in zip(gradients, expected_gradients, strict=True):
        assert torch.equal(gradient, expected_gradient)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_fp8_sites_compile_and_run(case, dtype):
    _, (actual, gradients) = _case_run(case, dtype, "fp8")
    assert torch.isfinite(actual).all()
    assert all(torch.isfinite(g).all() for g in gradients)


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_linear_of_the_shared_model_is_an_fp8_site(dtype):
    shared = _all_cases(dtype, "fp8")
    if isinstance(shared, Exception):
        raise shared
    assert shared[2] == 2  # proj and out


def _traced_spellings():
    """The Dynamo graph of all the cases, with its example values (the probe runs on them)."""
    captured = []

    def backend(gm, example_inputs):
        captured.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(Spellings(CASES), backend=backend, fullgraph=True)(torch.randn(ROWS, K))
    return captured[0]


def _bare_call(dunder: str) -> torch.fx.Node:
    """``a.<dunder>(b)`` in a graph of its own, without example values: the probe cannot run it."""
    graph = torch.fx.Graph()
    a, b = graph.placeholder("a"), graph.placeholder("b")
    node = graph.call_method(dunder, (a, b))
    graph.output(node)
    return node


def test_effects_of_every_dunder_never_raise_and_in_place_ones_write_their_first_argument():
    traced = [n for n in _traced_spellings().graph.nodes if n.op == "call_method" and n.target.startswith("__")]
    # Dynamo writes these as operator.neg, operator.getitem, ...
    assert {n.target for n in traced} >= TESTED - {"__neg__", "__pos__", "__abs__", "__getitem__", "__setitem__"}
    for node in traced + [_bare_call(dunder) for dunder in sorted(_tensor_dunders())]:
        effects = effects_of(node)  # read from schemas, by the probe (traced), from the spelling (bare)
        assert has_side_effects(node) == effects.any
        if node.target in IN_PLACE:
            assert effects.written == (node.args[0],), node.target
        elif node.target in TESTED:
            assert effects.written == () and not effects.draws_random, node.target  # __rand__ is a reflected &


def test_a_reader_that_raises_leaves_the_node_to_the_next(monkeypatch):
    def raises(node):
        raise AttributeError("'method-wrapper' object has no attribute 'overloads'")

    node = _bare_call("__iand__")
    monkeypatch.setattr(side_effects, "_effects_by_schema", raises)
    monkeypatch.setattr(side_effects, "_probe", raises)
    assert effects_of(node).written == (node.args[0],)  # read from its spelling
    node = _bare_call("__iand__")
    monkeypatch.setattr(side_effects, "_effects_by_spelling", raises)
    assert effects_of(node).written is UNKNOWN
    node = _bare_call("__add__")
    monkeypatch.setattr(side_effects, "_effects_by_kind", raises)
    assert effects_of(node).written is UNKNOWN


def test_a_comparison_method_compiles():
    # The report: h.__eq__(0) between two linears crashed the compile.
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(K, N), nn.Linear(N, K)

        def forward(self, x):
            h = self.a(x)
            return self.b(torch.where(h.__eq__(0), 0.0, h))

    x = torch.randn(ROWS, K)
    model = Model()
    expected = model(x)
    torch._dynamo.reset()
    actual = torch.compile(copy.deepcopy(model), backend="fp8", options={"compiler": "aot_eager"})(x)
    assert sqnr_db(expected, actual) > 20
