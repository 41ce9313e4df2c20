"""A kept FP8 cast never outlives its weight, and delayed scaling's kept casts follow Transformer Engine.

    outside fp8graph.weights_unchanged     every call casts its weights: any change, by any route, is read
    inside                                 the first call casts, the others reuse, unless a change fp8graph
                                           sees happened (an optimizer step, a version counter, a new tensor)

Delayed scaling is held to a plain-torch reference of Transformer Engine's delayed scaling
(:class:`TransformerEngineDelayedLinear`): with the weight cast at every call (``is_first_microbatch=None``)
outside a declaration, with its first-micro-batch caching inside one; for a weight that trains and one that
is frozen, with and without gradients for the input, and evaluation calls between.
"""

import copy

import pytest
import torch
from torch.nn.utils import prune

import fp8graph
from fp8graph.models import build
from fp8graph.models.moe import CONFIGS, MoEBlock
from fp8graph.recipes import PRESETS
from fp8graph.buffers.weight_cache import CACHED_WEIGHT_PREFIX
from fp8graph.numerics.delayed_scaling import scale_from_history
from helpers import sqnr_db

E4M3_MAX, E5M2_MAX = 448.0, 57344.0


class TransformerEngineDelayedLinear:
    """``y = x @ w^T`` with Transformer Engine's delayed scaling, in plain torch: HYBRID formats, the ``"max"``
    algorithm, margin 0. Roles: input, weight, grad_output, each a history (newest amax in slot 0) and a scale.

    A forward that trains casts the input and the weight with their scales and records their amaxes in slot 0;
    with ``weight_cache="reuse"`` (``is_first_microbatch=False``) it takes the cast the last ``"first"`` call kept,
    with its scale, and records nothing for the weight. Then each role's state moves: ``amax = max(history)``,
    the history rolls (newest to the end, slot 0 zeroed), ``scale = fp8_max / amax`` if that is finite and > 0.
    A backward does the same for grad_output. An evaluation call casts with the stored scales and moves nothing.
    """

    def __init__(self, weight: torch.Tensor, history_len: int):
        self.weight = weight.detach().float()
        self.history = torch.zeros(3, history_len)
        self.scale = torch.ones(3)
        self.kept: tuple[torch.Tensor, torch.Tensor] | None = None

    @staticmethod
    def _cast(x, scale, fp8_max, dtype):
        return (x * scale).clamp(-fp8_max, fp8_max).to(dtype)

    def _move(self, row: int) -> None:
        amax = self.history[row].max()
        rolled = torch.roll(self.history[row], -1)  # the newest to the end, the oldest (slot 1) to slot 0 ...
        rolled[0] = 0  # ... where it is dropped
        self.history[row] = rolled
        if torch.isfinite(amax) and amax > 0:
            self.scale[row] = E4M3_MAX / amax if row < 2 else E5M2_MAX / amax

    def forward(self, x: torch.Tensor, weight_cache: str | None = None, train: bool = True):
        x = x.detach().float()
        x_fp8 = self._cast(x, self.scale[0], E4M3_MAX, torch.float8_e4m3fn)
        if weight_cache == "reuse":
            w_fp8, w_scale = self.kept
        else:
            w_fp8, w_scale = self._cast(self.weight, self.scale[1], E4M3_MAX, torch.float8_e4m3fn), self.scale[1].clone()
            if weight_cache == "first":
                self.kept = (w_fp8, w_scale)
        output = (x_fp8.float() @ w_fp8.float().t()) * (1 / self.scale[0] * (1 / w_scale))
        self._for_backward = (w_fp8, w_scale)
        if train:
            self.history[0, 0] = x.abs().max()
            if weight_cache != "reuse":
                self.history[1, 0] = self.weight.abs().max()
            self._move(0)
            self._move(1)
        return output

    def backward(self, grad_output: torch.Tensor) -> torch.Tensor:
        """grad_input of the last forward (which trained)."""
        grad_output = grad_output.detach().float()
        grad_fp8 = self._cast(grad_output, self.scale[2], E5M2_MAX, torch.float8_e5m2)
        w_fp8, w_scale = self._for_backward
        grad_input = (grad_fp8.float() @ w_fp8.float()) * (1 / self.scale[2] * (1 / w_scale))
        self.history[2, 0] = grad_output.abs().max()
        self._move(2)
        return grad_input


def _frozen_linear():
    """One linear whose weight is frozen (an adapter fine-tune's base weight, std 0.002: its first casts, at the
    empty history's scale 1, land among E4M3's subnormals) and whose bias trains."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(256, 256)
    with torch.no_grad():
        linear.weight.normal_(0, 0.002)
    linear.weight.requires_grad_(False)
    return linear


@pytest.mark.parametrize("input_grad", [False, True], ids=["no input grad", "input grad"])
@pytest.mark.parametrize("declared", [False, True], ids=["per call", "two micro-batches declared"])
def test_delayed_scaling_with_a_frozen_weight_follows_transformer_engine(declared, input_grad):
    """Six steps, each of one call (outside any declaration: the weight cast at every call), or of two micro-batches
    in a declaration (the first casts and keeps, the second reuses), an optimizer step on the bias, and an
    evaluation call: every output (and grad_input) as Transformer Engine's, within float32 rounding. Before casts
    followed the history, the kept cast stayed at the first call's scale 1: 11 dB from it at every step after
    the first."""
    recipe = fp8graph.DelayedScaling(amax_history_len=4)
    linear = _frozen_linear()
    reference = TransformerEngineDelayedLinear(linear.weight, recipe.amax_history_len)
    model = torch.nn.Sequential(linear)
    compiled = fp8graph.compile(model, policy=recipe, compiler="aot_eager")
    optimizer = torch.optim.SGD([linear.bias], lr=0.01)
    generator = torch.Generator().manual_seed(1)
    worst = float("inf")
    for step in range(6):
        micro_batches = [None, None] if declared else [None]
        with fp8graph.weights_unchanged(compiled) if declared else _nothing():
            for index, _ in enumerate(micro_batches):
                x = torch.randn(64, 256, generator=generator).requires_grad_(input_grad)
                grad_output = torch.randn(64, 256, generator=generator)
                output = compiled(x)
                output.backward(grad_output)
                expected = reference.forward(x, None if not declared else "first" if index == 0 else "reuse")
                worst = min(worst, sqnr_db(expected, output - linear.bias))
                expected_grad_input = reference.backward(grad_output)
                if input_grad:
                    worst = min(worst, sqnr_db(expected_grad_input, x.grad))
        optimizer.step()
        optimizer.zero_grad()
        with torch.no_grad():
            x = torch.randn(64, 256, generator=generator)
            worst = min(worst, sqnr_db(reference.forward(x, train=False), compiled(x) - linear.bias))
    # The scales the next call casts with (fp8graph keeps the history before its roll and the scale last used;
    # Transformer Engine the history after it and the next scale).
    next_scales = scale_from_history(model[0].fp8graph_amax_history_weight, model[0].fp8graph_scale_weight,
                                     torch.float8_e4m3fn, 0, "max")
    assert torch.equal(next_scales, reference.scale[:2])
    assert worst > 100, worst


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_a_training_weight_under_declared_micro_batches_follows_transformer_engine():
    """A weight that trains: each step's declaration casts it at its first micro-batch, with the scale its history
    gives, and the optimizer step that follows makes the next declaration cast it again."""
    recipe = fp8graph.DelayedScaling(amax_history_len=3)
    torch.manual_seed(0)
    linear = torch.nn.Linear(128, 64, bias=False)
    compiled = fp8graph.compile(torch.nn.Sequential(linear), policy=recipe, compiler="aot_eager")
    optimizer = torch.optim.SGD(linear.parameters(), lr=0.5)
    generator = torch.Generator().manual_seed(2)
    reference = TransformerEngineDelayedLinear(linear.weight, 3)
    for step in range(4):
        reference.weight = linear.weight.detach().float().clone()  # as the last step left it
        with fp8graph.weights_unchanged(compiled):
            for index in range(3):
                x = torch.randn(32, 128, generator=generator)
                output = compiled(x)
                output.square().mean().backward()
                expected = reference.forward(x, "first" if index == 0 else "reuse")
                reference.backward(2 * output.detach() / output.numel())
                assert sqnr_db(expected, output) > 100, (step, index)
        optimizer.step()
        optimizer.zero_grad()


_KEEPING = [  # (recipe, model, cache_weights): every recipe that keeps copies, matrices and experts
    ("current", "mlp", "auto"), ("delayed", "mlp", "auto"), ("rowwise", "mlp", True), ("block", "mlp", True),
    ("mxfp8", "mlp", True), ("current", "moe", "auto"), ("delayed", "moe", "auto"), ("rowwise", "moe", "auto"),
    ("mxfp8", "moe", "auto"),
]


def _model(kind: str):
    if kind == "moe":
        return MoEBlock(**CONFIGS["tiny"]).to(torch.bfloat16), torch.randn(8, 64, dtype=torch.bfloat16)
    model = torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.ReLU(), torch.nn.Linear(128, 128))
    return model, torch.randn(16, 128)


class _OtherLibraryOptimizer:
    """An optimizer of another library: no ``torch.optim.Optimizer``, it writes the weights' memory itself."""

    def __init__(self, params):
        self.params = list(params)

    def step(self):
        for param in self.params:
            param.data.sub_(0.01 * torch.sign(param.data))


def _routes(model: torch.nn.Module, weights: list[torch.Tensor]):
    """Every way one of ``weights`` changes that a kept cast must see: (name, change)."""
    masters = [p.detach().float().clone() for p in weights]

    def through_data_copy():
        for param, master in zip(weights, masters):
            master.mul_(1.5)
            param.data.copy_(master.to(param.dtype))  # mixed precision's fp32 master weights

    def load():
        state = model.state_dict(keep_vars=True)
        model.load_state_dict({name: value.detach() * 0.5 if id(value) in kept else value.detach()
                               for name, value in state.items() if not name.split(".")[-1].startswith("fp8graph_")},
                              strict=False)

    def assign():
        weights[0].data = weights[0].data * 2

    kept = {id(weight) for weight in weights}

    return [
        ("in place, seen by autograd", lambda: torch.no_grad()(lambda: weights[0].mul_(2))()),
        ("param.data.add_", lambda: weights[0].data.add_(0.1)),
        ("param.data.copy_ from fp32 masters", through_data_copy),
        ("foreach over .data", lambda: torch._foreach_mul_([p.data for p in weights], 0.75)),
        ("param.data = ...", assign),
        ("load_state_dict", load),
        ("another library's optimizer", _OtherLibraryOptimizer(weights).step),
    ]


@pytest.mark.parametrize("recipe_name, kind, cache_weights", _KEEPING, ids=[f"{r}-{k}" for r, k, _ in _KEEPING])
def test_every_route_that_changes_a_weight_is_read_by_the_next_call(recipe_name, kind, cache_weights):
    """Outside a declaration, after each route the next call computes what a model casting at every call computes
    from the changed weights, bit for bit: nothing kept can be stale. Inside one, the routes fp8graph sees (an
    in-place change autograd sees, ``param.data = ...``, ``load_state_dict``, any torch optimizer's step) make the
    next call cast again."""
    policy = PRESETS[recipe_name]
    model, x = _model(kind)
    per_call_model = copy.deepcopy(model)
    compiled = fp8graph.compile(model, policy=policy, compiler="aot_eager", cache_weights=cache_weights)
    per_call = fp8graph.compile(per_call_model, policy=policy, compiler="eager", cache_weights=False)  # the same ops
    cache = compiled.fp8graph_backend.weight_cache
    assert cache is not None and len(cache) > 0
    kept = [param for param in model.parameters() if id(param) in cache.layouts()]  # the weights with copies

    def matches_per_call() -> bool:
        per_call_model.load_state_dict({name: value for name, value in model.state_dict().items()
                                        if not name.split(".")[-1].startswith("fp8graph_cached")}, strict=False)
        with torch.no_grad():
            return torch.equal(compiled(x), per_call(x))

    with fp8graph.weights_unchanged(compiled), torch.no_grad():
        compiled(x)  # a declaration that closed: what it kept is gone with it
    for name, change in _routes(model, kept):
        change()
        assert matches_per_call(), name
        assert cache.mode == "per call", name
    seen = {"in place, seen by autograd", "param.data = ...", "load_state_dict"}
    for name, change in _routes(model, kept):
        if name not in seen:
            continue
        with fp8graph.weights_unchanged(compiled), torch.no_grad():
            assert matches_per_call() and cache.mode == "fill"
            assert matches_per_call() and cache.mode == "reuse"
            change()
            assert matches_per_call() and cache.mode == "fill", name
    with fp8graph.weights_unchanged(compiled), torch.no_grad():
        compiled(x)
        torch.optim.SGD(torch.nn.Linear(1, 1).parameters()).step()  # any optimizer's step, even another model's
        assert matches_per_call() and cache.mode == "fill"


@pytest.mark.parametrize("recipe_name", ["current", "delayed"])
def test_a_gqa_llama_updated_through_data_trains_as_when_cast_at_every_call(recipe_name):
    """The update written ``p.data.add_(p.grad, alpha=-lr)`` and ``p.data.copy_(fp32 master - lr * grad)`` (mixed
    precision's master weights), four steps, with the default options: the losses of casting at every call. (With
    the casts kept while version counters stood still, current scaling's losses were 5.52, 5.39, 5.31, 5.21 where
    casting at every call gives 5.52, 5.15, 4.91, 4.94.)"""
    runs = []
    for cache_weights in ("auto", False):
        torch._dynamo.reset()
        model = build("llama", "tiny")
        # The reference casting at every call runs fp8graph's eager compiler: the same ATen ops, bit for bit.
        compiled = fp8graph.compile(model, policy=PRESETS[recipe_name], cache_weights=cache_weights,
                                    compiler="aot_eager" if cache_weights else "eager")
        masters = {name: p.detach().clone() for name, p in model.named_parameters()}
        tokens = torch.randint(0, 250, (2, 16), generator=torch.Generator().manual_seed(0))
        losses = []
        for step in range(4):
            loss = compiled(tokens, labels=tokens).loss
            loss.backward()
            losses.append(loss.item())
            for name, param in model.named_parameters():
                if step % 2:
                    masters[name].sub_(0.1 * param.grad)
                    param.data.copy_(masters[name])
                else:
                    param.data.add_(param.grad, alpha=-0.1)
                    masters[name].copy_(param.data)
                param.grad = None
        runs.append(losses)
    assert runs[0] == runs[1]
    assert runs[0][3] < runs[0][0] - 0.3  # it trains


def test_a_declaration_holds_the_copies_only_while_open_and_casts_anew_when_opened_again():
    model = build("mlp", "tiny")
    compiled = fp8graph.compile(model, compiler="aot_eager")
    cache = compiled.fp8graph_backend.weight_cache
    x = torch.randn(8, 64)
    copy_name = CACHED_WEIGHT_PREFIX + "weight"
    assert getattr(model.up, copy_name).numel() == 0  # no memory outside
    modes = []
    with torch.no_grad():
        for _ in range(2):
            with fp8graph.weights_unchanged(compiled):
                assert getattr(model.up, copy_name).shape == model.up.weight.shape
                for _ in range(2):
                    compiled(x)
                    modes.append(cache.mode)
                with fp8graph.weights_unchanged(model):  # nested: the same declaration (the user's module works too)
                    compiled(x)
                    modes.append(cache.mode)
            assert getattr(model.up, copy_name).numel() == 0
            compiled(x)
            modes.append(cache.mode)
    assert modes == ["fill", "reuse", "reuse", "per call"] * 2
    assert compiled.fp8graph_backend.graph_count == 3  # per call, fill, reuse
    with pytest.raises(TypeError, match="needs a model compiled by fp8graph.compile"):
        with fp8graph.weights_unchanged(torch.nn.Linear(4, 4)):
            pass


def test_outside_a_declaration_a_model_with_copies_computes_as_one_without():
    """The per-call graph of a model with weight buffers is the graph of ``cache_weights=False``: bit for bit the
    losses and gradients, and no copy read or written."""
    results = []
    for cache_weights in ("auto", False):
        torch._dynamo.reset()
        model = build("llama", "tiny")
        compiled = fp8graph.compile(model, compiler="aot_eager", cache_weights=cache_weights)
        tokens = torch.randint(0, 250, (2, 16), generator=torch.Generator().manual_seed(0))
        loss = compiled(tokens, labels=tokens).loss
        loss.backward()
        results.append((loss, [p.grad for p in model.parameters()],
                        ["cached_weight" in name for gm in compiled.fp8graph_backend.graph_modules
                         for name in map(str, gm.graph.nodes)]))
    (loss, grads, reads), (per_call_loss, per_call_grads, _) = results
    assert torch.equal(loss, per_call_loss) and not any(reads)
    assert all(torch.equal(a, b) for a, b in zip(grads, per_call_grads, strict=True))


def test_param_data_moved_to_another_view_of_the_same_storage_is_seen():
    """Double buffering in one flat tensor: ``param.data`` moves to the other half of the same storage, with no
    version bump and the same storage address; the next call casts the other half."""
    model, x = _model("mlp")
    per_call_model = copy.deepcopy(model)
    compiled = fp8graph.compile(model, compiler="aot_eager")
    per_call = fp8graph.compile(per_call_model, compiler="aot_eager", cache_weights=False)
    weight, cache = model[0].weight, compiled.fp8graph_backend.weight_cache
    flat = torch.cat([weight.data.reshape(-1), weight.data.reshape(-1) * 2])
    weight.data = flat[:weight.numel()].view_as(weight)
    with fp8graph.weights_unchanged(compiled), torch.no_grad():
        compiled(x), compiled(x)
        assert cache.mode == "reuse"
        weight.data = flat[weight.numel():].view_as(weight)
        per_call_model[0].weight.data = weight.data.clone()
        assert torch.equal(compiled(x), per_call(x)) and cache.mode == "fill"


def test_a_pruned_weight_inside_a_declaration_is_cast_at_every_call():
    """``torch.nn.utils.prune`` moves the weight out of the module's parameters: it has no copy, and the call
    computes as one casting per call."""
    model, x = _model("mlp")
    per_call_model = copy.deepcopy(model)
    compiled = fp8graph.compile(model, compiler="aot_eager")
    with torch.no_grad():
        compiled(x)
    for pruned in (model, per_call_model):
        prune.l1_unstructured(pruned[0], "weight", amount=0.5)
    per_call = fp8graph.compile(per_call_model, compiler="aot_eager", cache_weights=False)
    with fp8graph.weights_unchanged(compiled), torch.no_grad():
        for _ in range(2):
            assert torch.equal(compiled(x), per_call(x))


def test_a_declaration_that_fails_to_open_leaves_none_open():
    """Allocating the copies can fail (out of memory, which batch-size finders catch and retry): the model is
    then outside every declaration, as before."""
    model, x = _model("mlp")
    compiled = fp8graph.compile(model, compiler="aot_eager")
    scope = compiled.fp8graph_backend.weight_cache.scope

    def out_of_memory():
        raise RuntimeError("out of memory")

    scope.on_open.insert(0, out_of_memory)
    with pytest.raises(RuntimeError, match="out of memory"):
        with fp8graph.weights_unchanged(compiled):
            pass
    scope.on_open.remove(out_of_memory)
    assert not scope.open
    with torch.no_grad():
        compiled(x)
    assert compiled.fp8graph_backend.weight_cache.mode == "per call"


def test_a_copy_of_the_model_taken_inside_a_declaration_is_outside_every_declaration():
    """``copy.deepcopy`` (an EMA or evaluation copy) inside a block: the copy's calls cast per call, so a later
    ``param.data`` write to the copy, outside any block of its own, is read."""
    model, x = _model("mlp")
    compiled = fp8graph.compile(model, compiler="aot_eager")
    with fp8graph.weights_unchanged(compiled), torch.no_grad():
        compiled(x)
        copied = copy.deepcopy(compiled)
    copied_model = copied._orig_mod if hasattr(copied, "_orig_mod") else copied
    assert not copied.fp8graph_backend.weight_cache.scope.open
    copied_model[0].weight.data.mul_(2)
    reference = fp8graph.compile(copy.deepcopy(copied_model), compiler="aot_eager", cache_weights=False)
    with torch.no_grad():
        assert torch.equal(copied(x), reference(x)) and copied.fp8graph_backend.weight_cache.mode == "per call"


def test_a_weight_replaced_by_one_of_another_shape_is_refused_by_a_declaration_naming_it():
    """A resized head: outside a block the call recompiles and casts per call; a block, whose copies were laid
    out for the old shape, refuses to open and says to compile again."""
    model, x = _model("mlp")
    compiled = fp8graph.compile(model, compiler="aot_eager")
    with torch.no_grad():
        compiled(x)
        model[2].weight = torch.nn.Parameter(torch.cat([model[2].weight, torch.randn(16, 128)]))
        model[2].bias = torch.nn.Parameter(torch.cat([model[2].bias, torch.zeros(16)]))
        assert compiled(x).shape == (16, 144)
        with pytest.raises(ValueError, match=r"weight of Linear is \(144, 128\) now.*compile\(model\) again"):
            with fp8graph.weights_unchanged(compiled):
                pass
    assert not compiled.fp8graph_backend.weight_cache.scope.open
