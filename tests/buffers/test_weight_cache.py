"""cache_weights: each weight quantized once per ``fp8graph.weights_unchanged`` declaration, not once per call.

    with fp8graph.weights_unchanged(compiled):
        micro-batch 1           -> fill graph: quantize the weights, keep the FP8 copies
        micro-batches 2..n      -> reuse graph: read the copies
        optimizer step, load_state_dict, an in-place change autograd sees -> the next call fills again
    outside                     -> every call quantizes its weights (the graph of cache_weights=False)

The cached run must equal the uncached one bit for bit (delayed scaling: as Transformer Engine's
first-micro-batch caching, tests/buffers/test_kept_casts.py).
"""

import copy
import math

import pytest
import torch
from torch._inductor.utils import run_and_get_code

import fp8graph
from fp8graph.gemm.scaled_gemm import Lowering
from fp8graph.models import build
from fp8graph.models.moe import CONFIGS, MoEBlock
from fp8graph.recipes import PRESETS
from fp8graph.targets.grouped import GroupedSpec, _cast_expert_columns, cast_experts, grouped_fp8_target
from fp8graph.gemm.tiled_operands import expert_blocks
from fp8graph.numerics.formats import Role
from fp8graph.gemm.tiled_operands import cached_weight_operands
from fp8graph.buffers.delayed_state import HISTORY_PREFIX, SCALE_PREFIX
from fp8graph.buffers.weight_cache import (CACHED_SCALE_PREFIX, CACHED_TRANSPOSE_PREFIX, CACHED_WEIGHT_PREFIX,
                                           COPY_PREFIXES)
from fp8graph.numerics.delayed_scaling import scale_from_history
from fp8graph.numerics.quantize import quantize
from helpers import fp8_target_count

MICRO_BATCHES, STEPS = 3, 3
AMAX_REDUCTION = "max_propagate_nan"  # one call per reduced vector in Inductor's C++ (see test_inference)


def _accumulate(model, compiled, generator, dtype=torch.float32):
    """Gradient accumulation: STEPS optimizer steps of MICRO_BATCHES micro-batches; losses and modes."""
    return _accumulate_on(model, compiled, lambda generator: torch.randn(32, 64, generator=generator).to(dtype),
                          generator)


def _accumulate_on(model, compiled, batch, generator=None, before_step=lambda: None):
    """:func:`_accumulate` on the micro-batches ``batch(generator)`` makes, each step's declared to see the same
    weights, ``before_step()`` called after them inside the declaration."""
    generator = generator if generator is not None else torch.Generator().manual_seed(1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, reused = [], []
    cache = compiled.fp8graph_backend.weight_cache
    for _ in range(STEPS):
        with fp8graph.weights_unchanged(compiled):
            for _ in range(MICRO_BATCHES):
                loss = compiled(batch(generator)).float().square().mean()
                loss.backward()
                losses.append(loss.item())
                reused.append(cache is not None and cache.reuse)
            before_step()
        optimizer.step()
        optimizer.zero_grad()
    return losses, reused


@pytest.mark.parametrize("compiler", ["aot_eager", pytest.param("inductor", marks=pytest.mark.inductor)])
def test_gradient_accumulation_with_cached_weights_equals_without(compiler):
    model = build("mlp", "tiny")
    cached_model = copy.deepcopy(model)
    losses, _ = _accumulate(model, fp8graph.compile(model, compiler=compiler, cache_weights=False),
                            torch.Generator().manual_seed(1))
    torch._dynamo.reset()
    compiled = fp8graph.compile(cached_model, compiler=compiler, cache_weights=True)
    cached_losses, reused = _accumulate(cached_model, compiled, torch.Generator().manual_seed(1))
    assert cached_losses == losses
    for name, param in model.named_parameters():
        assert torch.equal(dict(cached_model.named_parameters())[name], param), name
    # The first micro-batch after each step fills, the others reuse; one graph of each kind.
    assert reused == [False, True, True] * STEPS
    assert compiled.fp8graph_backend.graph_count == 2
    # A new declaration fills the copies with the current weights' quantization (up and mid; head's N=10 stays
    # in high precision); outside one they hold no memory.
    with fp8graph.weights_unchanged(compiled), torch.no_grad():
        compiled(torch.randn(32, 64))
        assert not compiled.fp8graph_backend.weight_cache.reuse
        for module in (cached_model.up, cached_model.mid):
            weight_fp8, scale = fp8graph.numerics.quantize.quantize_current(module.weight.detach(),
                                                                            torch.float8_e4m3fn)
            assert torch.equal(getattr(module, CACHED_WEIGHT_PREFIX + "weight").view(torch.uint8),
                               weight_fp8.view(torch.uint8))
            assert torch.equal(getattr(module, CACHED_SCALE_PREFIX + "weight"), scale)
    assert getattr(cached_model.up, CACHED_WEIGHT_PREFIX + "weight").numel() == 0
    assert not hasattr(cached_model.head, CACHED_WEIGHT_PREFIX + "weight")


def _bits(x: torch.Tensor) -> torch.Tensor:
    """An FP8 tensor's bytes (torch.equal of FP8 tensors is not defined everywhere); another tensor as it is."""
    return x.view(torch.uint8) if x.dtype.itemsize == 1 else x


class _KNProjection(torch.nn.Module):
    """``x @ weight`` of a (K, N) weight: a module that leaves the orientation to the site."""

    def __init__(self, k, n):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(k, n) / k ** 0.5)

    def forward(self, x):
        return x @ self.weight


@pytest.mark.parametrize("recipe, compiler", [("rowwise", "aot_eager"), ("block", "aot_eager"),
                                              ("mxfp8", "aot_eager"),
                                              pytest.param("mxfp8", "inductor", marks=pytest.mark.inductor)])
def test_tiled_recipes_keep_both_gemms_weight_casts_and_train_as_when_cast_at_every_call(recipe, compiler):
    """Row-wise and MXFP8 keep the forward's cast (along K) and grad_input's (along N); block scaling's 128x128
    tiles keep one, which grad_input reads transposed. A (K, N) weight multiplied as ``x @ w`` keeps them in
    its own shape. Bit for bit the losses and weights of casting at every call (under Inductor's C++ code too,
    which compiles MXFP8's fill only with one node a kernel: fp8graph.backend). Kept with cache_weights=True
    only: their fill casts a matrix more than a call casting it does, and "auto" says so."""
    model = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.ReLU(), _KNProjection(256, 128))
    cached_model = copy.deepcopy(model)
    policy = PRESETS[recipe]
    checked = []

    def copies_are_the_weights_casts():
        square = recipe == "block"
        for module, weight_nk in ((cached_model[0], cached_model[0].weight),
                                  (cached_model[2], cached_model[2].weight.t())):
            copies = [getattr(module, prefix + "weight") for prefix in COPY_PREFIXES[:2 if square else 4]]
            expected = cached_weight_operands(weight_nk.detach(), policy)
            if module is cached_model[2]:  # kept in the weight's own (K, N) shape: the pairs swapped, or transposed
                expected = [operand.t() for operand in expected] if square else expected[2:] + expected[:2]
            for copy_, operand in zip(copies, expected, strict=True):
                assert copy_.shape == operand.shape
                assert torch.equal(_bits(copy_), _bits(operand.contiguous()))
        checked.append(True)

    def train(model, compiled, before_step=lambda: None):
        return _accumulate_on(model, compiled, lambda generator: torch.randn(32, 128, generator=generator),
                              before_step=before_step)

    losses, _ = train(model, fp8graph.compile(model, policy=policy, compiler=compiler, cache_weights=False))
    plan = fp8graph.plan(cached_model, policy)  # cache_weights="auto"
    assert [entry.fp8_copy for entry in plan] == ["per call"] * 2
    assert "a tiled recipe's fill casts a matrix more" in str(plan)
    torch._dynamo.reset()
    compiled = fp8graph.compile(cached_model, policy=policy, compiler=compiler, cache_weights=True)
    # Each step's copies are the casts of the weights its micro-batches saw (after the first, trained ones).
    cached_losses, reused = train(cached_model, compiled, copies_are_the_weights_casts)
    assert cached_losses == losses and reused == [False, True, True] * STEPS and checked == [True] * STEPS
    for name, param in model.named_parameters():
        assert torch.equal(dict(cached_model.named_parameters())[name], param), name
    assert sum(d.rewritten for d in compiled.fp8graph_backend.decisions) == 2 * 2  # both sites, both graphs
    if compiler == "aot_eager":  # an inference call's fill too (under Inductor an inference graph more to compile)
        with fp8graph.weights_unchanged(compiled), torch.no_grad():
            compiled(torch.randn(32, 128))  # fills the copies from the last step's weights
            copies_are_the_weights_casts()


class _SharedThrice(torch.nn.Module):
    """One Linear called three times a forward, on 3-D and 2-D inputs: a shared layer."""

    def __init__(self):
        super().__init__()
        self.shared = torch.nn.Linear(128, 128)

    def forward(self, x):
        tokens = self.shared(self.shared(x))  # (2, 16, 128)
        return tokens.sum(0) + self.shared(tokens.flatten(0, 1)[:16])


class _CheckpointedFirst(torch.nn.Module):
    """The shared Linear's first call inside a checkpoint body, which the graph's passes see after the graph
    around it, its second after the body."""

    def __init__(self):
        super().__init__()
        self.shared, self.other = torch.nn.Linear(128, 128), torch.nn.Linear(128, 128)

    def forward(self, x):
        inner = torch.utils.checkpoint.checkpoint(lambda h: torch.relu(self.shared(h)), x, use_reentrant=False)
        return self.shared(self.other(inner))


class _BlockOnFewRows(torch.nn.Module):
    """The shared Linear's first call in row-wise (the default), its second on 16 rows in block scaling (a rule):
    the copies are block scaling's, which the first call does not read."""

    def __init__(self):
        super().__init__()
        self.shared = torch.nn.Linear(128, 128)

    def forward(self, x):  # (2, 16, 128)
        rows = self.shared(x.flatten(0, 1))  # 32 rows
        return rows[:16] + self.shared(rows[:16])


_FEW_ROWS_IN_BLOCKS = fp8graph.Policy(default=PRESETS["rowwise"], rules=[
    (lambda path, module, site: isinstance(site.M, int) and site.M <= 16, PRESETS["block"])])


@pytest.mark.parametrize("make, policy", [
    (_SharedThrice, PRESETS["rowwise"]), (_SharedThrice, PRESETS["block"]), (_SharedThrice, PRESETS["mxfp8"]),
    (_CheckpointedFirst, PRESETS["rowwise"]), (_BlockOnFewRows, _FEW_ROWS_IN_BLOCKS)],
    ids=["thrice-rowwise", "thrice-block", "thrice-mxfp8", "checkpointed-first", "another-recipe-first"])
def test_one_call_of_a_tiled_weight_fills_its_copies_whatever_the_order(make, policy):
    """A filling graph's tiled call reads the copies it wrote and saves them for its backward. Every call of the
    weight wrote them, and a third call's write changed what the first had saved (autograd refused the graph:
    "modified by an inplace operation"); a call that only read them could run before the writer (the first call
    inside a checkpoint body, which the passes see last) or the first call take another recipe's copies. One call
    of the weight that takes the copies writes and reads them; the others cast the weight themselves. Bit for bit
    the losses and weights of casting at every call."""
    torch.manual_seed(0)
    model = make()
    cached_model = copy.deepcopy(model)

    def train(model, compiled):
        return _accumulate_on(model, compiled, lambda generator: torch.randn(2, 16, 128, generator=generator))

    # The reference casting at every call runs fp8graph's eager compiler: the same ATen ops, bit for bit.
    losses, _ = train(model, fp8graph.compile(model, policy=policy, compiler="eager", cache_weights=False))
    torch._dynamo.reset()
    compiled = fp8graph.compile(cached_model, policy=policy, compiler="aot_eager", cache_weights=True)
    cached_losses, reused = train(cached_model, compiled)
    assert cached_losses == losses and reused == [False, True, True] * STEPS
    assert all(math.isfinite(loss) for loss in losses)
    for name, param in model.named_parameters():
        assert torch.equal(dict(cached_model.named_parameters())[name], param), name


@pytest.mark.parametrize("recipe", ["current", "rowwise", "mxfp8"])
@pytest.mark.parametrize("weights", ["enk", "ekn"])
def test_expert_weights_are_cast_once_per_step_and_train_as_when_cast_at_every_call(weights, recipe):
    """A MoE block's expert weights, (E, N, K) or stored (E, K, N): E4M3 copies in both layouts (per expert: one
    cast laid out twice, a scale an expert; row-wise: cast along K and along N, a scale a row of each; MXFP8:
    blocks of 32 along K and along N, a scale a block of each), filled by the first micro-batch after each step
    and read by the others (forward and grad_input)."""
    # MXFP8's blocks of 32 need every K and N to divide by 32: "tiny"'s expert width, 32, does.
    block = MoEBlock(**CONFIGS["tiny" if recipe == "mxfp8" else "tiny-odd"], weights=weights).to(torch.bfloat16)
    cached_block = copy.deepcopy(block)
    policy = PRESETS[recipe]
    compiled = fp8graph.compile(block, policy=policy, compiler="eager", cache_weights=False)  # the same ATen ops
    losses, _ = _accumulate(block, compiled, torch.Generator().manual_seed(1), torch.bfloat16)
    expert_gemms = [d for d in compiled.fp8graph_backend.decisions if d.rewritten]
    assert [d.site.path for d in expert_gemms] == ["experts", "experts"]  # gate_up and down
    torch._dynamo.reset()
    compiled = fp8graph.compile(cached_block, policy=policy, compiler="aot_eager")  # cache_weights="auto"
    cached_losses, reused = _accumulate(cached_block, compiled, torch.Generator().manual_seed(1), torch.bfloat16)
    assert cached_losses == losses and reused == [False, True, True] * STEPS
    targets = [[n.target.__name__ for n in gm.graph.nodes
                if getattr(n.target, "__name__", "").startswith("fp8graph_grouped")]
               for gm in compiled.fp8graph_backend.graph_modules]
    assert [[name.split("_cached_weight")[0].rsplit("_", 1)[1] for name in names] for names in targets] == [
        ["fill"] * 2, ["reuse"] * 2]  # the fill graph, the reuse one
    for name, param in block.named_parameters():
        assert torch.equal(dict(cached_block.named_parameters())[name], param), name
    with fp8graph.weights_unchanged(compiled), torch.no_grad():
        compiled(torch.randn(32, 64, dtype=torch.bfloat16))  # fills the copies from the last step's weights
        experts = cached_block.experts
        spec = GroupedSpec(expert_gemms[0].recipe, Lowering.EMULATED)
        for name in ("gate_up_proj", "down_proj"):
            weight = getattr(experts, name).detach()
            weight_nk = weight.transpose(-2, -1) if weights == "ekn" else weight
            weight_fp8, scale, _ = cast_experts(weight_nk, spec)  # along K: the forward's
            copies = [getattr(experts, prefix + name, None) for prefix in COPY_PREFIXES[:4]]
            assert copies[0].shape == weight.shape and copies[0].dtype == torch.float8_e4m3fn
            assert copies[0].is_contiguous() and copies[2].is_contiguous()  # the layouts the two GEMMs read
            forward_copy, forward_scale, input_grad_copy, input_grad_scale = (
                [copies[2], copies[3], copies[0], copies[1]] if weights == "ekn" and recipe != "current" else
                [copies[2], copies[1], copies[0], None] if weights == "ekn" else copies)
            if recipe == "mxfp8":  # blocks along K for the forward, along N for grad_input, a scale a block of each
                tiling = policy.tiling(Role.WEIGHT)
                weight_fp8, scale = expert_blocks(weight_nk, tiling)
                columns_fp8, columns_scale = expert_blocks(weight_nk.transpose(-2, -1), tiling)
                assert torch.equal(input_grad_copy.view(torch.uint8), columns_fp8.view(torch.uint8)), name
                assert torch.equal(input_grad_scale, columns_scale), name
            assert torch.equal(forward_copy.view(torch.uint8), weight_fp8.view(torch.uint8)), name
            assert torch.equal(forward_scale, scale), name
            if recipe == "mxfp8":
                continue
            if recipe == "rowwise":  # grad_input's cast along N, a scale a column
                columns_fp8, columns_scale = _cast_expert_columns(weight_nk, spec)
                assert torch.equal(input_grad_copy.view(torch.uint8), columns_fp8.view(torch.uint8)), name
                assert torch.equal(input_grad_scale, columns_scale), name
            else:  # the one cast, laid out for grad_input
                assert input_grad_scale is None
                assert torch.equal(input_grad_copy.view(torch.uint8), weight_fp8.transpose(-2, -1).view(torch.uint8))


@pytest.mark.inductor
def test_mxfp8_expert_copies_under_inductor_train_as_when_cast_at_every_call():
    """Inductor's code for MXFP8's expert fill (two block casts of each weight, written into the copies) and
    reuse, bit-equal to casting at every call (on the CPU its C++ code compiles the fill one node a kernel:
    fp8graph.backend)."""
    block = MoEBlock(**CONFIGS["tiny"]).to(torch.bfloat16)
    per_call_block = copy.deepcopy(block)
    runs = []
    for model, cache_weights in ((block, "auto"), (per_call_block, False)):
        torch._dynamo.reset()
        compiled = fp8graph.compile(model, policy=PRESETS["mxfp8"], compiler="inductor", cache_weights=cache_weights)
        generator, losses, reused = torch.Generator().manual_seed(3), [], []
        with fp8graph.weights_unchanged(compiled):
            for _ in range(MICRO_BATCHES):
                loss = compiled(torch.randn(32, 64, generator=generator).to(torch.bfloat16)).float().square().mean()
                loss.backward()
                losses.append(loss.item())
                reused.append(compiled.fp8graph_backend.weight_cache is not None and
                              compiled.fp8graph_backend.weight_cache.reuse)
            filled = model.experts._buffers.get("fp8graph_cached_weight_gate_up_proj")
            reused.append(filled is not None and filled.view(torch.uint8).any().item())
        runs.append((losses, [param.grad for param in model.parameters()], reused))
    (losses, grads, reused), (per_call_losses, per_call_grads, _) = runs
    assert reused == [False, True, True, True]
    assert losses == per_call_losses
    assert all(torch.equal(grad, per_call_grad) for grad, per_call_grad in zip(grads, per_call_grads))


def test_an_expert_target_refuses_a_kept_copy_it_cannot_serve():
    """MXFP8's expert copies come with their blocks' scales; a per-expert scale cannot serve them."""
    target = grouped_fp8_target(PRESETS["mxfp8"], Lowering.EMULATED, True, "fill")
    fp8 = torch.float8_e4m3fn
    copies = {"cached_weight": torch.zeros(2, 16, 32, dtype=fp8), "cached_weight_scale": torch.ones(2, 1),
              "cached_weight_t": torch.zeros(2, 32, 16, dtype=fp8)}
    with pytest.raises(ValueError, match="MXFP8's with its blocks' scales"):
        target(torch.randn(8, 32, dtype=torch.bfloat16), torch.randn(2, 16, 32, dtype=torch.bfloat16),
               torch.tensor([4, 8], dtype=torch.int32), **copies)


@pytest.mark.inductor
def test_the_reuse_graph_does_not_quantize_the_weights():
    model = build("mlp", "tiny")
    compiled = fp8graph.compile(model, compiler="inductor", cache_weights=True)
    x = torch.randn(32, 64)
    with fp8graph.weights_unchanged(compiled), torch.no_grad():
        _, fill_code = run_and_get_code(compiled, x)
        _, reuse_code = run_and_get_code(compiled, x)
    fill_reductions, reuse_reductions = ("\n".join(code).count(AMAX_REDUCTION) for code in (fill_code, reuse_code))
    # Per call: fill reduces both inputs and both weights, reuse only the two inputs.
    assert fill_reductions == 2 * reuse_reductions > 0


@pytest.mark.parametrize("options", [{"cache_weights": True}, {"stats": True},
                                     {"policy": fp8graph.DelayedScaling(amax_history_len=4)}],
                         ids=["cache_weights", "stats", "delayed"])
def test_converting_the_model_after_compiling_is_refused_until_it_is_compiled_again(options):
    """model.to(bfloat16) converts fp8graph's buffers too: the call names them; compiling again restores them."""
    model = build("mlp", "tiny")
    compiled = fp8graph.compile(model, compiler="aot_eager", **options)
    x = torch.randn(8, 64)
    compiled(x).sum().backward()
    dtypes = {name: buffer.dtype for name, buffer in model.named_buffers()}
    model.to(torch.bfloat16)
    with pytest.raises(Exception, match=r"fp8graph's buffers changed dtype after fp8graph.compile, e\.g\. "
                                        r"(<root>|up)\.fp8graph_\w+ \(torch.bfloat16, registered as torch\.float.*"
                                        r"Call fp8graph.compile\(model, ...\) again after converting the model"):
        compiled(x.bfloat16())
    compiled = fp8graph.compile(model, compiler="aot_eager", **options)
    assert {name: buffer.dtype for name, buffer in model.named_buffers()} == dtypes
    output = compiled(x.bfloat16())
    assert output.dtype == torch.bfloat16 and torch.isfinite(output).all()
    output.float().sum().backward()


def _leaf_buffers(model: torch.nn.Module, prefix: str) -> dict[str, torch.Tensor]:
    return {name: buffer for name, buffer in model.named_buffers() if name.rsplit(".", 1)[-1].startswith(prefix)}


@pytest.mark.parametrize("model_name", ["mlp", "moe"])
def test_delayed_copies_keep_the_fills_cast_and_scale_and_reusing_calls_record_no_weight_amax(model_name):
    """Delayed scaling keeps each weight's cast and the scale it was cast with from the first micro-batch of a
    declaration; the others cast the weight with that scale and record no amax for it (zero: its history slot
    stays empty, as Transformer Engine's cached weights leave it); the input rows move as at every call. Dense
    linears and expert weights (E, N, K). The whole semantics against Transformer Engine's:
    tests/buffers/test_kept_casts.py."""
    recipe = fp8graph.DelayedScaling(amax_history_len=4)
    model, dtype = ((build("mlp", "tiny"), torch.float32) if model_name == "mlp" else
                    (MoEBlock(**CONFIGS["tiny-odd"]).to(torch.bfloat16), torch.bfloat16))
    compiled = fp8graph.compile(model, policy=recipe, compiler="aot_eager")  # cache_weights="auto"
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(1)
    for step in range(2):
        fill_scales = {}
        with fp8graph.weights_unchanged(compiled):
            for micro_batch in range(MICRO_BATCHES):
                histories_before = {name: h.clone() for name, h in _leaf_buffers(model, HISTORY_PREFIX).items()}
                x = torch.randn(32, 64, generator=generator).to(dtype)
                compiled(x).float().square().mean().backward()
                assert compiled.fp8graph_backend.weight_cache.reuse == (micro_batch > 0)
                scales = _leaf_buffers(model, SCALE_PREFIX)
                histories = _leaf_buffers(model, HISTORY_PREFIX)
                assert len(histories) == 2  # mlp: up and mid (head's N=10 stays in high precision); moe: 2 experts
                for name, scale in scales.items():
                    history_before = histories_before[name.replace(SCALE_PREFIX, HISTORY_PREFIX)]
                    history = histories[name.replace(SCALE_PREFIX, HISTORY_PREFIX)]
                    if micro_batch == 0:  # the fill: the scales the histories give, as casting at every call
                        fill_scales[name] = scale.clone()
                        assert torch.equal(scale, scale_from_history(history_before, scale, torch.float8_e4m3fn,
                                                                     0, "max"))
                        assert (history[1:, 0] > 0).all()  # the weight rows record the weight's amax
                    else:  # rows: the input's, then the weight's (one an expert): kept, and nothing recorded
                        assert torch.equal(scale[1:], fill_scales[name][1:]), (step, micro_batch, name)
                        assert (history[1:, 0] == 0).all() and (history[:1, 0] > 0).all(), (step, micro_batch)
            for name, history in _leaf_buffers(model, HISTORY_PREFIX).items():  # the copies: the fill's cast
                path, leaf = name.rsplit(".", 1) if "." in name else ("", name)
                module, weight_name = model.get_submodule(path), leaf.removeprefix(HISTORY_PREFIX)
                weight = getattr(module, weight_name).detach()
                kept_scale = getattr(module, CACHED_SCALE_PREFIX + weight_name).reshape(-1)
                assert torch.equal(kept_scale, fill_scales[name.replace(HISTORY_PREFIX, SCALE_PREFIX)][1:]), name
                expected = quantize(weight, kept_scale.reshape(-1, *[1] * (weight.dim() - 1)).squeeze(0),
                                    torch.float8_e4m3fn)
                assert torch.equal(_bits(getattr(module, CACHED_WEIGHT_PREFIX + weight_name)), _bits(expected)), name
                if weight.dim() == 3:  # grad_input's layout, the same cast
                    assert torch.equal(_bits(getattr(module, CACHED_TRANSPOSE_PREFIX + weight_name)),
                                       _bits(expected.transpose(-2, -1).contiguous())), name
        optimizer.step()
        optimizer.zero_grad()


def test_expert_weights_stored_column_major_keep_copies_and_expert_sites_of_block_scaling_keep_none():
    """An (E, N, K) expert weight laid out column-major (read as stored) keeps its copies as a row-major one does,
    and trains as casting at every call; block scaling's expert sites stay in high precision, so their weights
    get no copies."""
    block = MoEBlock(**CONFIGS["tiny-odd"]).to(torch.bfloat16)
    with torch.no_grad():
        for name in ("gate_up_proj", "down_proj"):
            weight = getattr(block.experts, name)
            setattr(block.experts, name, torch.nn.Parameter(weight.transpose(1, 2).contiguous().transpose(1, 2)))
    per_call_block = copy.deepcopy(block)
    losses = [_accumulate_on(m, fp8graph.compile(m, policy=PRESETS["current"], compiler="aot_eager",
                                                 cache_weights=cache_weights),
                             lambda generator: torch.randn(32, 64, generator=generator).to(torch.bfloat16))[0]
              for m, cache_weights in ((block, "auto"), (per_call_block, False))]
    assert losses[0] == losses[1] and hasattr(block.experts, CACHED_WEIGHT_PREFIX + "gate_up_proj")
    block_scaled = MoEBlock(hidden=128, experts=4, top_k=2, expert_width=128).to(torch.bfloat16)  # whole tiles
    fp8graph.compile(block_scaled, policy=PRESETS["block"], compiler="aot_eager")
    assert not any(name.startswith("fp8graph_cached") for name, _ in block_scaled.experts.named_buffers())


def test_a_delayed_copy_filled_without_gradients_is_filled_again_by_a_training_call():
    """An evaluation right after the optimizer step fills the copies with the stored scales (a call without
    gradients moves no state); the training call after it fills again, with the scale its history gives,
    and the micro-batches after that reuse its copy."""
    model = build("mlp", "tiny")
    compiled = fp8graph.compile(model, policy=fp8graph.DelayedScaling(amax_history_len=4), compiler="aot_eager")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    cache, modes = compiled.fp8graph_backend.weight_cache, []
    x = torch.randn(32, 64)
    with fp8graph.weights_unchanged(compiled):  # one declaration: the optimizer steps end each reuse
        for _ in range(2):
            for _ in range(2):
                compiled(x).square().mean().backward()
                modes.append(cache.reuse)
            optimizer.step()
            optimizer.zero_grad()
            history_before = model.up.fp8graph_amax_history_weight.clone()
            with torch.no_grad():
                compiled(x)
                modes.append(cache.reuse)
            assert torch.equal(model.up.fp8graph_amax_history_weight, history_before)  # read, not moved
        compiled(x).square().mean().backward()
        modes.append(cache.reuse)
        expected = scale_from_history(history_before, model.up.fp8graph_scale_weight, torch.float8_e4m3fn, 0, "max")
        assert modes == [False, True, False] * 2 + [False]  # the eval fills; so does the training call after it
        assert model.up.fp8graph_scale_weight[1] == expected[1]  # the history's, not the stored one's
        assert getattr(model.up, CACHED_SCALE_PREFIX + "weight") == expected[1]


def test_tied_weights_share_one_copy_and_each_recipe_keeps_its_own():
    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.first, self.second = torch.nn.Linear(32, 32), torch.nn.Linear(32, 32)
            self.second.weight = self.first.weight
            self.rowwise = torch.nn.Linear(32, 32)

        def forward(self, x):
            return self.rowwise(self.second(x))

    model = Tied()
    policy = fp8graph.Policy(rules=[("rowwise", fp8graph.DelayedScaling(amax_history_len=4))])
    compiled = fp8graph.compile(model, policy=policy, compiler="aot_eager", cache_weights=True)
    x = torch.randn(16, 32)
    with fp8graph.weights_unchanged(compiled), torch.no_grad():
        outputs = [compiled(x) for _ in range(2)]
        first_copy = getattr(model.first, CACHED_WEIGHT_PREFIX + "weight")
        assert first_copy.view(torch.uint8).any()  # filled through the second holder's call
    assert compiled.fp8graph_backend.weight_cache.reuse
    assert len(compiled.fp8graph_backend.weight_cache) == 2  # first.weight (second holds it too), rowwise.weight
    assert not hasattr(model.second, CACHED_WEIGHT_PREFIX + "weight")
    assert torch.equal(outputs[0], outputs[1])


def test_a_weight_untied_after_compiling_is_cast_at_every_call_and_never_served_the_others_copy():
    """``b.weight = nn.Parameter(...)`` unties a weight the model was compiled with tied: b's sites read no copy
    (the one kept is of a's weight), inside a declaration too, and see their weight's changes."""

    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(64, 64, bias=False), torch.nn.Linear(64, 64, bias=False)
            self.b.weight = self.a.weight

        def forward(self, x):
            return self.b(torch.relu(self.a(x)))

    torch.manual_seed(0)
    model = Tied()
    compiled = fp8graph.compile(model, compiler="aot_eager")
    x = torch.randn(8, 64)
    compiled(x)
    model.b.weight = torch.nn.Parameter(model.a.weight.detach() * 3)
    reference_model = copy.deepcopy(model)
    reference = fp8graph.compile(reference_model, compiler="aot_eager", cache_weights=False)
    with fp8graph.weights_unchanged(compiled), torch.no_grad():
        for _ in range(2):
            assert torch.equal(compiled(x), reference(x))
        model.b.weight.mul_(0.5)
        reference_model.b.weight.mul_(0.5)
        assert torch.equal(compiled(x), reference(x))


def test_cache_weights_is_refused_where_it_cannot_work():
    with pytest.raises(ValueError, match="choose one"):
        fp8graph.compile(build("mlp", "tiny"), cache_weights=True, freeze_weights=True)
    with pytest.raises(ValueError, match="cache_weights=True needs an nn.Module"):
        fp8graph.compile(lambda x: x, cache_weights=True)
    with pytest.raises(ValueError, match="has none"):
        fp8graph.compile(torch.nn.Linear(32, 32), cache_weights=True)


def test_cached_weights_under_activation_checkpointing_match_uncached():
    """A checkpointed region's forward is replayed in backward; the replay of a fill
    rewrites the same copies, and losses and gradients stay those of the uncached run."""
    base = build("llama", "tiny")
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    def run(cache_weights):
        torch._dynamo.reset()
        model = copy.deepcopy(base)
        compiled = fp8graph.compile(model, compiler="aot_eager", cache_weights=cache_weights)
        losses, _ = _declared_micro_batches(compiled, torch.Generator().manual_seed(0))
        return losses, [param.grad for param in model.parameters()], compiled

    losses, grads, _ = run(False)
    cached_losses, cached_grads, compiled = run(True)
    assert cached_losses == losses
    assert all(torch.equal(cached, plain) for cached, plain in zip(cached_grads, grads, strict=True))
    assert len(compiled.fp8graph_backend.weight_cache) == 14  # every projection; lm_head's N=250 is not FP8


def test_explain_after_a_reusing_call_fills_and_reports_every_site():
    model = build("mlp", "tiny")
    compiled = fp8graph.compile(model, compiler="aot_eager", cache_weights=True)
    x = torch.randn(8, 64)
    with fp8graph.weights_unchanged(compiled), torch.no_grad():
        expected = compiled(x)
        compiled(x)
        assert compiled.fp8graph_backend.weight_cache.reuse
        model.up.weight.zero_()  # a change the explain run must not read stale copies over
        model.up.weight.add_(1)
        report = fp8graph.explain(compiled, x)
        assert [r.recipe is not None for r in report] == [True, True, False]
        assert getattr(model.up, CACHED_WEIGHT_PREFIX + "weight").float().unique().numel() == 1  # all ones, scaled
        assert not torch.equal(compiled(x), expected)


def test_a_second_compile_whose_policy_caches_other_weights_is_refused_naming_the_weight():
    model = build("mlp", "tiny")
    fp8graph.compile(model, compiler="aot_eager", cache_weights=True)
    again = fp8graph.compile(model, compiler="aot_eager", cache_weights=True)  # the same policy: adopted
    assert again.fp8graph_backend.weight_cache is not None
    with pytest.raises(ValueError, match=r"mid\.weight: the model was compiled before with FP8 weight copies, and "
                                         r"its copies cannot serve this policy \(it asks for no copy"):
        fp8graph.compile(model, compiler="aot_eager", cache_weights=True,
                         policy=fp8graph.Policy(rules=[("mid", None)]))


def _train_with_accumulation(model, compiled, steps=2, before_step=lambda: None):
    """``steps`` SGD steps of MICRO_BATCHES token micro-batches, ``before_step()`` called after each step's
    micro-batches, inside their declaration (the weights they saw and the copies still in place); every loss, and
    the modes the calls ran in."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(0)
    losses, reused = [], []
    for _ in range(steps):
        step_losses, step_reused = _declared_micro_batches(compiled, generator, before_step)
        losses += step_losses
        reused += step_reused
        optimizer.step()
        optimizer.zero_grad()
    return losses, reused


def _declared_micro_batches(compiled, generator, last=lambda: None):
    """MICRO_BATCHES token micro-batches declared to see the same weights, ``last()`` called after them inside the
    declaration: their losses, and whether each read the kept casts."""
    cache = compiled.fp8graph_backend.weight_cache
    losses, reused = [], []
    with fp8graph.weights_unchanged(compiled):
        for _ in range(MICRO_BATCHES):
            tokens = torch.randint(0, 250, (2, 16), generator=generator)
            loss = compiled(tokens, labels=tokens).loss
            loss.backward()
            losses.append(loss.item())
            reused.append(cache is not None and cache.reuse)
        last()
    return losses, reused


@pytest.mark.parametrize("compiler", ["aot_eager", pytest.param("inductor", marks=pytest.mark.inductor)])
def test_gpt2_conv1d_weights_stored_k_n_get_n_k_copies_and_train_like_uncached(compiler):
    """GPT-2's Conv1D stores its weight (K, N) and runs ``addmm(b, x2d, w)``: the linear multiplies
    ``w.t()``, and the copy is laid out (N, K) like an nn.Linear's. Each step's copies are the cast of the weights
    its micro-batches saw (the second step's, of the weights the first step trained), checked before the optimizer
    moves them: no inference graph compiled for it (an inference call's fill: the MLP tests)."""
    model = build("gpt2", "tiny")
    cached_model = copy.deepcopy(model)
    # Uncached, the graphs of tests/test_backend.py's GPT-2 test (the same config and token shape): kept alike, so
    # that a suite run compiles them once.
    losses, _ = _train_with_accumulation(model, fp8graph.compile(model, compiler=compiler, cache_weights=False))
    torch._dynamo.reset()
    compiled = fp8graph.compile(cached_model, compiler=compiler, cache_weights=True)
    checked = []

    def copies_are_the_weights_casts():
        for path in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"):  # (64, 192), (64, 64), (64, 256), ...
            module = cached_model.get_submodule(f"transformer.h.0.{path}")
            weight_fp8, _ = fp8graph.numerics.quantize.quantize_current(module.weight.detach().t(),
                                                                        torch.float8_e4m3fn)
            assert torch.equal(getattr(module, CACHED_WEIGHT_PREFIX + "weight").view(torch.uint8),
                               weight_fp8.contiguous().view(torch.uint8)), path
        checked.append(True)

    cached_losses, reused = _train_with_accumulation(cached_model, compiled, before_step=copies_are_the_weights_casts)
    assert cached_losses == losses and checked == [True, True]
    assert reused == [False, True, True] * 2
    for name, param in model.named_parameters():
        assert torch.equal(dict(cached_model.named_parameters())[name], param), name


def test_a_weight_multiplied_k_n_by_an_unknown_module_is_read_through_its_copy_transposed():
    """``x @ w`` with w (K, N) in a module of its own: which way round it multiplies w is only known from
    the graph, so the copy keeps w's shape and the linear reads it transposed."""
    model = torch.nn.Sequential(_KNProjection(64, 96), torch.nn.ReLU(), _KNProjection(96, 64))
    cached_model = copy.deepcopy(model)
    x = torch.randn(4, 8, 64)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    cached_optimizer = torch.optim.SGD(cached_model.parameters(), lr=0.1)
    compiled = fp8graph.compile(model, compiler="aot_eager", cache_weights=False)
    cached = fp8graph.compile(cached_model, compiler="aot_eager", cache_weights=True)
    for _ in range(2):
        for run, opt in ((compiled, optimizer), (cached, cached_optimizer)):
            with fp8graph.weights_unchanged(cached):
                for _ in range(2):  # fill, then reuse
                    run(x).square().mean().backward()
                for module in (cached_model[0], cached_model[2]) if run is cached else ():
                    copy_fp8 = getattr(module, CACHED_WEIGHT_PREFIX + "weight")
                    assert copy_fp8.shape == module.weight.shape and copy_fp8.view(torch.uint8).any()
            opt.step()
            opt.zero_grad()
    assert cached.fp8graph_backend.weight_cache.reuse
    assert sum(fp8_target_count(gm) for gm in cached.fp8graph_backend.graph_modules) == 2 * 2  # fill and reuse graphs
    for param, cached_param in zip(model.parameters(), cached_model.parameters(), strict=True):
        assert torch.equal(param, cached_param)


def test_a_fused_optimizer_step_refills_though_it_moves_no_version_counter():
    """AdamW(fused=True) writes the weights in one kernel and leaves their version counters where they were (the
    default optimizer of HuggingFace's Trainer on a GPU): the step itself makes the next call fill."""
    model = build("mlp", "tiny")
    reference = copy.deepcopy(model)
    compiled = fp8graph.compile(model, compiler="aot_eager")
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    x = torch.randn(8, 64)
    versions = [p._version for p in model.parameters()]
    with fp8graph.weights_unchanged(compiled):  # a declaration the step is inside of
        compiled(x).square().mean().backward()
        optimizer.step()
        assert [p._version for p in model.parameters()] == versions  # the hazard: nothing moved
        optimizer.zero_grad()
        with torch.no_grad():
            output = compiled(x)
        assert not compiled.fp8graph_backend.weight_cache.reuse  # filled from the stepped weights
    reference.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert torch.equal(output, fp8graph.compile(reference, compiler="aot_eager", cache_weights=False)(x))



class _TwoHeads(torch.nn.Module):
    """A body and two task heads, one picked per call: micro-batches of two tasks multiply different weights."""

    def __init__(self):
        super().__init__()
        self.body, self.head_a, self.head_b = torch.nn.Linear(64, 64), torch.nn.Linear(64, 32), torch.nn.Linear(64, 32)

    def forward(self, x, task: str):
        h = torch.relu(self.body(x))
        return self.head_a(h) if task == "a" else self.head_b(h)


def _equal_to_casting_per_call(model, compiled, calls):
    """Each call of ``calls`` ((args, mode expected)) inside one declaration, against the same model cast at
    every call: outputs and the gradients of their sum bit for bit."""
    reference_model = copy.deepcopy(model)
    reference = fp8graph.compile(reference_model, compiler="aot_eager", cache_weights=False,
                                 policy=compiled.fp8graph_backend.policy, dynamic=False)
    cache = compiled.fp8graph_backend.weight_cache
    with fp8graph.weights_unchanged(compiled):
        for args, mode in calls:
            output = compiled(*args)
            assert cache.mode == mode
            assert torch.equal(output, reference(*args)), (args[1:], mode)
            output.sum().backward()
            reference(*args).sum().backward()
    for parameter, reference_parameter in zip(model.parameters(), reference_model.parameters()):
        assert torch.equal(parameter.grad, reference_parameter.grad)


def test_a_module_the_declarations_fill_did_not_call_writes_its_copies_when_it_is_called():
    """The first call of a declaration fills the copies of the weights it multiplies; a later call through a
    module it did not call (another task's head) casts that module's weights and writes its copies, then reuses
    them, where it would otherwise read copies never written (zeros, a scale of 0: NaN)."""
    torch.manual_seed(0)
    model = _TwoHeads()
    compiled = fp8graph.compile(model, compiler="aot_eager", dynamic=False)
    x = torch.randn(8, 64)
    _equal_to_casting_per_call(model, compiled, [((x, "a"), "fill"), ((x, "b"), "reuse"), ((x, "b"), "reuse"),
                                                 ((x, "a"), "reuse")])


def test_copies_a_fill_left_unwritten_because_its_sites_stayed_in_high_precision_are_never_read_unwritten():
    """A policy deciding by the token count (as ``policies.auto()`` does) keeps a short call's sites in BF16: that
    call's fill writes no copy, and a longer call, whose sites are in FP8, must not read them unwritten."""
    policy = fp8graph.Policy(default=fp8graph.Float8CurrentScaling(),
                             rules=[(lambda path, module, site: isinstance(site.M, int) and site.M < 32, None)])
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64))
    compiled = fp8graph.compile(model, policy=policy, compiler="aot_eager", dynamic=False)
    short, long = torch.randn(8, 64), torch.randn(64, 64)
    _equal_to_casting_per_call(model, compiled, [((short,), "fill"), ((long,), "reuse"), ((long,), "reuse")])


def test_a_weight_whose_sites_stay_in_high_precision_does_not_stop_its_modules_other_weights_reusing():
    """The experts module holds gate_up and down; a policy deciding by the token count keeps down in BF16, so
    down's copies are never written. gate_up's are read from the second call on, and down is never read
    unwritten: each weight's copies are filled or read on their own."""
    torch.manual_seed(0)
    block = MoEBlock(**CONFIGS["tiny"]).to(torch.bfloat16)
    width = CONFIGS["tiny"]["expert_width"]
    policy = fp8graph.Policy(rules=[(lambda path, module, site: site.M is not None and site.K == width, None)])
    reference = fp8graph.compile(copy.deepcopy(block), policy=policy, compiler="aot_eager", cache_weights=False)
    compiled = fp8graph.compile(block, policy=policy, compiler="aot_eager")
    x = torch.randn(8, 64, dtype=torch.bfloat16)
    with fp8graph.weights_unchanged(compiled), torch.no_grad():
        for _ in range(2):
            assert torch.equal(compiled(x), reference(x))
    calls = [getattr(n.target, "__name__", "") for gm in compiled.fp8graph_backend.graph_modules
             for n in gm.graph.nodes if getattr(n.target, "__name__", "").startswith("fp8graph_grouped_")]
    assert [("_fill_" in name, "_reuse_" in name) for name in calls] == [(True, False), (False, True)]
