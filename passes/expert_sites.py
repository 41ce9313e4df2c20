"""The GEMMs of a mixture-of-experts layer: its experts' grouped GEMMs and its router.

HuggingFace's MoE families (``@use_experts_implementation``, ``"grouped_mm"``, the default in BF16)
sort the tokens by expert and run each expert projection as one grouped GEMM over them::

    torch._grouped_mm(x (S, K), W.transpose(-2, -1) (E, K, N), offs=offsets (E,))   W stored (E, N, K)
    torch._grouped_mm(x (S, K), W (E, K, N), offs=offsets)                          W stored (E, K, N): gpt-oss
    torch.ops.transformers.grouped_mm_fallback(x, W.transpose(-2, -1), offsets)      other dtypes under Dynamo
    torch.bmm(x (E, T, K), W (E, K, N))                                              every expert, T tokens each:
                                                                                     Llama-4's dense experts
    torch.bmm(W[expert_ids], x.unsqueeze(-1))                                        weights gathered per token:
                                                                                     batched_mm decode

:func:`read_grouped` fills a :class:`~fp8graph.passes.sites.GroupedExpertSite` of op
``grouped_mm`` with ``experts`` (E) and ``offsets_node``, in linear form (``weight_node`` the 3-D
parameter, ``weight_is_kn`` for a (E, K, N) one). :func:`read_dense_experts` reads the ``bmm`` form into a
grouped expert site of op ``bmm`` with no offsets: its groups are the E slices of T tokens.
:func:`read_gathered_experts` reads the decode form into a :class:`~fp8graph.passes.sites.GatheredExpertSite`; it
runs in FP8 only with frozen weights, each expert's cast folded into a constant that
``fp8graph::gathered_gemv`` reads in place. Grouped GEMMs the FP8 target cannot take (no offsets, a bias, a
weight computed in the graph) carry a ``blocker``.

The sorted tokens reach the first expert GEMM as a row gather of the hidden states,
``x_sorted = hidden[perm // top_k]`` (S = T top_k rows of T). :func:`read_gather` records that
``gather_source`` and ``gather_index`` when nothing else reads the gathered rows (an in-place write
into them, transformers' expert-parallel ``masked_fill_``, keeps the gather as it is): the rewrite then
casts the T source rows and gathers FP8 bytes (``fp8graph.targets.grouped``), where the gathered BF16
rows would be written, then read for the amax and again for the cast.

Between the two GEMMs of an expert MLP, ``gate, up = out.chunk(2, -1); h = silu(gate) * up``:
:func:`read_swiglu` records those nodes when nothing else reads them, and the rewrite may give the activation to
the first GEMM's call (``fp8graph.targets.grouped.fuses_neighbours``), whose backward then casts SwiGLU's gradient
in the kernel that computes it. After the last GEMM, the combine, ``y = out * w[perm].unsqueeze(-1);
y[inverse].view(T, top_k, N).sum(dim=1)``: :func:`read_combine` records it when nothing else reads its nodes, and
the rewrite may give it to that GEMM's call, whose backward then casts its grad_output (the combine's gradient,
gathered and weighted) and the routing weights' gradient from one read.

The router is a plain linear whose output picks the experts (it reaches ``topk``); a shared-expert gate
is a one-column linear whose sigmoid scales the shared expert's output. FP8 error in either flips
routing decisions or the shared expert's weight, which no FP8 system accepts: :func:`mark_gates`
sets ``site.gate``, and only a policy rule naming the site moves it to FP8 (``passes.annotate``).
The pass only reads the graph.
"""

from __future__ import annotations

import operator
from typing import Callable

import torch
import torch.fx

from fp8graph.gemm.scaled_gemm import Lowering
from fp8graph.numerics.groups import ExpertGemm, weight_copies_kept, weight_copy_fits
from fp8graph.recipes.scaling import FP8_GEMM_DIM_MULTIPLE, NATIVE_GROUPED_GRANULARITIES

from .node_values import argument, tensor_value
from .side_effects import has_side_effects
from .sites import ExpertSite, GatheredExpertSite, GroupedExpertSite
from .unpermute import unpermuting

__all__ = ["GROUPED_OP", "expert_mlps", "is_grouped_gemm", "mark_gates", "pair_expert_stages", "pool_weight_copies",
           "read_dense_experts", "read_gather", "read_gathered_experts", "read_combine", "read_grouped", "read_swiglu"]

GROUPED_OP = "grouped_mm"
_GROUPED_FUNCTIONS = {torch._grouped_mm} | ({torch.nn.functional.grouped_mm}
                                           if hasattr(torch.nn.functional, "grouped_mm") else set())
_FALLBACK_OP = "transformers::grouped_mm_fallback"
# How far past a linear's output the routing may look for topk: a softmax or sigmoid, a cast, a view,
# a bias (DeepSeek-V3: sigmoid, add its correction bias, group the scores, topk of the groups).
_ROUTER_HOPS = 8
_TOPK = {torch.topk, "topk"}
_SIGMOID = {torch.sigmoid, torch.nn.functional.sigmoid, "sigmoid"}


def _is_fallback_op(target) -> bool:
    """transformers' op, as Dynamo records it (its packet) or as an overload."""
    if isinstance(target, torch._ops.OpOverload):
        target = target.overloadpacket
    return isinstance(target, torch._ops.OpOverloadPacket) and target._qualified_op_name == _FALLBACK_OP


def is_grouped_gemm(node: torch.fx.Node) -> bool:
    """``torch._grouped_mm`` / ``F.grouped_mm``, or transformers' opaque fallback op."""
    return node.op == "call_function" and (node.target in _GROUPED_FUNCTIONS or _is_fallback_op(node.target))


def _rows(dim) -> int | str:
    """A token count as a site records it: an int, or the symbol's text (a symbolic dimension is never compared:
    that would guard, or specialize, the graph on it)."""
    return dim if isinstance(dim, int) else str(dim)


def read_grouped(site: GroupedExpertSite, node: torch.fx.Node, resolve) -> None:
    """Fill ``site`` (op ``grouped_mm``) from a grouped GEMM ``node``; ``resolve(node)`` gives
    ``(parameter node, transposed)`` of a parameter operand (``find_sites._Parameters.resolve``)."""
    site.input_node = argument(node, 0, ("mat_a", "input"))
    right = argument(node, 1, ("mat_b", "weight"))
    site.offsets_node = argument(node, 2, ("offs", "offsets"))
    site.bias_node = None
    weight, transposed = resolve(right)
    input_value, right_value = tensor_value(site.input_node), tensor_value(right)
    if input_value is not None:
        site.dtype = input_value.dtype
    if right_value is not None and right_value.dim() == 3:
        site.experts, site.K, site.N = right_value.shape
    if input_value is not None and input_value.dim() == 2:
        site.M = _rows(input_value.shape[0])
    if weight is None:
        site.blocker = "expert weights computed in the graph (not a 3-D parameter or its transpose)"
    elif input_value is None or right_value is None or input_value.dim() != 2 or right_value.dim() != 3:
        site.blocker = "grouped GEMM not of tokens (S, K) by experts (E, K, N)"
    elif site.offsets_node is None:
        site.blocker = "grouped GEMM without offsets: no token groups to scale"
    elif not is_grouped_fallback(node) and (argument(node, 3, ("bias",)) is not None
                                             or argument(node, 4, ("out_dtype",)) not in (None, input_value.dtype)):
        site.blocker = "grouped GEMM with a bias or another output dtype"
    if weight is not None:
        # The op multiplies by (E, K, N): the parameter itself is (E, K, N) unless transposed into it.
        site.weight_node, site.weight_is_kn = weight, not transposed


def read_dense_experts(where: dict, input_node, weight: torch.fx.Node, transposed: bool) -> GroupedExpertSite:
    """``torch.bmm(x (E, T, K), weight)`` of a 3-D parameter ``weight`` (``transposed``: fed as
    ``W.transpose(-2, -1)`` of a (E, N, K) parameter), as an expert site of E groups of T tokens; ``where``
    holds the site's node, op, path and module type."""
    input_value, weight_value = tensor_value(input_node), tensor_value(weight)
    experts, rows, columns = weight_value.shape
    site = GroupedExpertSite(**where, input_node=input_node, weight_node=weight, weight_is_kn=not transposed,
                             dtype=input_value.dtype if input_value is not None else None, experts=experts)
    site.K, site.N = (columns, rows) if transposed else (rows, columns)
    if input_value is None or input_value.dim() != 3 or input_value.shape[0] != experts:
        site.blocker = "batched GEMM of expert weights whose batch is not the experts"
        return site
    tokens = input_value.shape[1]
    site.M = experts * tokens if isinstance(tokens, int) else f"{experts} * {tokens}"
    return site


_GATHERED_BLOCKER = ("expert weights gathered per token (transformers' batched_mm decode, W[expert_ids]): FP8 "
                     "reads them cast once, which needs frozen weights (fp8graph.compile(..., freeze_weights=True), "
                     "called under torch.no_grad()); cast at every call, all E experts' weights would be read to "
                     "serve the selected ones")


def _frozen(weight: torch.fx.Node) -> bool:
    """Whether ``weight`` is a constant of a graph Inductor freezes: its FP8 cast is then folded, done once."""
    from torch._inductor import config as inductor_config

    return weight.op == "get_attr" and inductor_config.freezing and not torch.is_grad_enabled()


def read_gathered_experts(where: dict, left, right, parameters) -> GatheredExpertSite | None:
    """The decode form, when one operand of a ``bmm`` is a 3-D parameter gathered per token, ``W[expert_ids]``
    (transformers' ``batched_mm`` decode): an expert site of E experts, rewritten only where the weights are
    frozen (see ``_GATHERED_BLOCKER``). ``where`` holds the site's node, op, path and module type;
    ``parameters`` is the graph's set of parameter nodes. None when neither operand is such a gather."""
    for operand, other, weight_first in ((left, right, True), (right, left, False)):
        if not (isinstance(operand, torch.fx.Node) and operand.op == "call_function"
                and operand.target is operator.getitem and operand.args[0] in parameters):
            continue
        weight_value, index_value = tensor_value(operand.args[0]), tensor_value(operand.args[1])
        if weight_value is None or weight_value.dim() != 3 or index_value is None \
                or index_value.is_floating_point() or index_value.dim() != 1 or index_value.dtype == torch.bool:
            continue
        # bmm(W[ids] (S, N, K), x (S, K, 1)) of (E, N, K) weights, or bmm(x (S, 1, K), W[ids] (S, K, N)) of
        # (E, K, N) ones, which the rewrite feeds transposed.
        site = GatheredExpertSite(**where, input_node=other, weight_node=operand.args[0],
                                  weight_is_kn=not weight_first, expert_ids_node=operand.args[1],
                                  experts=weight_value.shape[0], M=_rows(index_value.shape[0]),
                                  dtype=weight_value.dtype)
        site.N, site.K = weight_value.shape[1:] if weight_first else weight_value.shape[:0:-1]
        input_value = tensor_value(other)
        expected = (site.K, 1) if weight_first else (1, site.K)
        if input_value is None or input_value.dim() != 3 or tuple(input_value.shape[1:]) != expected:
            site.blocker = "batched GEMM of gathered expert weights by something other than one row per token"
        elif not _frozen(site.weight_node):
            site.blocker = _GATHERED_BLOCKER
        return site
    return None


def _same_dtype_copy(node) -> bool:
    """``x.to(dtype)`` / ``x.type(dtype)`` that keeps ``x``'s dtype: transformers' ``input.to(weight.dtype)``."""
    if not (isinstance(node, torch.fx.Node) and node.op == "call_method" and node.target in ("to", "type")):
        return False
    before, after = tensor_value(node.args[0]), tensor_value(node)
    return before is not None and after is not None and before.dtype == after.dtype \
        and before.device == after.device and len(node.users) == 1


def _side_effects_between(first: torch.fx.Node, last: torch.fx.Node) -> bool:
    """Whether a node strictly between ``first`` and ``last`` (in graph order) has side effects: a read moved from
    one to the other could see what it wrote."""
    between = first.next
    while between is not last:
        if has_side_effects(between):
            return True
        between = between.next
    return False


def read_gather(site: GroupedExpertSite) -> None:
    """Record the row gather ``site``'s input is (see the module's doc), if it is one only the site reads."""
    if site.offsets_node is None or site.blocker is not None:
        return
    gathered = site.input_node
    while _same_dtype_copy(gathered):
        gathered = gathered.args[0]
    if not (isinstance(gathered, torch.fx.Node) and gathered.op == "call_function"
            and gathered.target is operator.getitem and len(gathered.users) == 1):
        return
    source, index = gathered.args
    source_value, index_value, rows_value = tensor_value(source), tensor_value(index), tensor_value(gathered)
    if source_value is None or index_value is None or rows_value is None:
        return
    if not (source_value.dim() == 2 and index_value.dim() == 1 and not index_value.is_floating_point()
            and index_value.dtype != torch.bool and source_value.dtype == rows_value.dtype):
        return
    # The call gathers the rows where the GEMM is: nothing between may write the source or the index (an in-place
    # op, a method call on a view), or it would read rows the gather did not.
    if not _side_effects_between(gathered, site.node):
        site.gather_source, site.gather_index = source, index


_CHUNKS = {torch.chunk, "chunk"}
_SILU = {torch.nn.functional.silu, "silu"}
_MULTIPLY = {operator.mul, torch.mul, "mul"}


def _only_user(node: torch.fx.Node) -> torch.fx.Node | None:
    return next(iter(node.users)) if len(node.users) == 1 else None


def _is_call(node, targets: set) -> bool:
    return isinstance(node, torch.fx.Node) and node.op in ("call_function", "call_method") and node.target in targets


def read_swiglu(site: GroupedExpertSite) -> None:
    """Record ``silu(gate) * up`` of ``gate, up = output.chunk(2, -1)`` (see the module's doc) when the site's
    output (S, 2I) is read only by that chunk and each node on the way only by the next."""
    if site.offsets_node is None or site.blocker is not None:
        return
    output_value = tensor_value(site.node)
    chunk = _only_user(site.node)
    if output_value is None or output_value.dim() != 2 or output_value.shape[1] % 2 or not _is_call(chunk, _CHUNKS):
        return
    chunks = argument(chunk, 1, "chunks")
    dim = argument(chunk, 2, "dim")
    if argument(chunk, 0, "input") is not site.node or chunks != 2 or dim not in (-1, 1) or len(chunk.users) != 2:
        return
    halves = sorted(chunk.users, key=lambda user: user.args[1] if user.target is operator.getitem else -1)
    if any(half.target is not operator.getitem or half.args[1] != index for index, half in enumerate(halves)):
        return
    gate, up = halves
    silu = _only_user(gate)
    if not _is_call(silu, _SILU) or argument(silu, 1, "inplace") or argument(silu, 0, "input") is not gate:
        return
    product = _only_user(silu)
    if not _is_call(product, _MULTIPLY) or _only_user(up) is not product or set(product.args) != {silu, up} \
            or product.kwargs:
        return
    site.swiglu_nodes = (chunk, gate, up, silu, product)


_VIEWS = {"view", "reshape", torch.reshape}
_SUMS = {"sum", torch.sum}


def read_combine(site: GroupedExpertSite) -> None:
    """Record the experts' combine of the site's output (see the module's doc), ``((y * w)[inverse]).view(T, k,
    N).sum(dim=1)`` with ``w`` (S, 1) floating point (BF16, or fp32 as Mixtral's and DeepSeek-V3's routers give it:
    the product then fp32, as in the graph) and ``inverse`` proven the inverse of a permutation made before the
    product (``passes.unpermute``), when each node on the way is read only by the next and nothing between the
    GEMM and the product has side effects (the call takes the GEMM's place at the product). Shapes are compared as
    text: comparing symbols would guard the graph on them."""
    if site.offsets_node is None or site.blocker is not None or site.swiglu_nodes:
        return
    output_value = tensor_value(site.node)
    product = _only_user(site.node)
    if output_value is None or output_value.dim() != 2 or not _is_call(product, _MULTIPLY) or product.kwargs \
            or len(product.args) != 2 or site.node not in product.args:
        return
    weights = product.args[1] if product.args[0] is site.node else product.args[0]
    weights_value = tensor_value(weights)
    if weights is site.node or weights_value is None or str(tuple(weights_value.shape)) != str(
            (output_value.shape[0], 1)) or not weights_value.dtype.is_floating_point \
            or weights_value.device != output_value.device:
        return
    gather = _only_user(product)
    if not (isinstance(gather, torch.fx.Node) and gather.op == "call_function" and gather.target is operator.getitem
            and gather.args[0] is product):
        return
    unpermuted = unpermuting(gather)
    view = _only_user(gather)
    if unpermuted is None or not _is_call(view, _VIEWS) or argument(view, 0, "input") is not gather:
        return
    # The permutation sorted the GEMM's rows, and is made before the product, where the call will read it
    permutation = unpermuted[0]
    if str(tensor_value(permutation).shape[0]) != str(output_value.shape[0]):
        return
    after_product = product.next
    while after_product is not gather:
        if after_product is permutation:
            return
        after_product = after_product.next
    view_value, total = tensor_value(view), _only_user(view)
    if view_value is None or view_value.dim() != 3 or not isinstance(view_value.shape[1], int) \
            or str(view_value.shape[2]) != str(output_value.shape[1]) \
            or not _is_call(total, _SUMS) or argument(total, 0, "input") is not view:
        return
    dim = argument(total, 1, "dim")
    if (dim if not isinstance(dim, (tuple, list)) or len(dim) != 1 else dim[0]) not in (1, -2) \
            or argument(total, 2, "keepdim") or argument(total, 3, "dtype") is not None:
        return
    if _side_effects_between(site.node, product):
        return
    site.combine_nodes = (product, gather, view, total)
    site.combine_weights, site.combine_permutation = weights, permutation
    site.combine_top_k = view_value.shape[1]


def is_grouped_fallback(node: torch.fx.Node) -> bool:
    return _is_fallback_op(node.target)


def _reaches(node: torch.fx.Node, targets: set, hops: int, gemms: set) -> bool:
    """Whether ``targets`` use ``node``'s value within ``hops`` steps, not through another GEMM (``gemms``)."""
    frontier, seen = [node], {node}
    for _ in range(hops):
        following = []
        for current in frontier:
            for user in current.users:
                if user in seen:
                    continue
                seen.add(user)
                if user.target in targets:
                    return True
                if user.op in ("call_function", "call_method") and user not in gemms \
                        and user.target is not operator.setitem:
                    following.append(user)
        frontier = following
    return False


def expert_mlps(sites) -> list[tuple[GroupedExpertSite, GroupedExpertSite]]:
    """The expert MLPs the graph has whole, as ``(first, second)`` GEMM sites: a first GEMM whose output SwiGLU
    alone reads (``swiglu_nodes``), that SwiGLU the input of a second GEMM whose output the combine alone reads
    (``combine_nodes``)."""
    second_by_input = {site.input_node: site for site in sites
                       if isinstance(site, GroupedExpertSite) and site.combine_nodes}
    return [(first, second_by_input[first.swiglu_nodes[-1]]) for first in sites
            if isinstance(first, GroupedExpertSite) and first.swiglu_nodes
            and first.swiglu_nodes[-1] in second_by_input]


def pair_expert_stages(sites) -> None:
    """Give ``expert_stage`` to both GEMMs of each of :func:`expert_mlps`: 0 and 1. The site model's stage table
    was measured on that shape (the second GEMM's casts with the first's SwiGLU fused into them); a site outside
    such a pair is priced by the block's average."""
    for first, second in expert_mlps(sites):
        first.expert_stage, second.expert_stage = 0, 1


def pool_weight_copies(decisions, trained: Callable[[GroupedExpertSite], bool]) -> None:
    """Set ``pooled_weight_copy`` on the expert GEMMs of an expert MLP (:func:`expert_mlps`) that keep their
    weight's copy for grad_input only because what the MLP's two inputs save pays for it
    (``fp8graph.numerics.groups.weight_copies_kept``): both in FP8 on the native path, ``trained`` (their
    input saved for grad_weight) and outside activation checkpointing (which saves neither). A recipe that saves
    its transposes keeps its copies whatever they cost, and stays out of the pool."""
    decision_of = {id(decision.site): decision for decision in decisions}

    def pooled(decision) -> bool:
        site = decision.site
        return (decision.rewritten and decision.lowering is Lowering.SCALED_MM
                and decision.recipe.granularity in NATIVE_GROUPED_GRANULARITIES
                and not decision.recipe.save_transposes and site.checkpoint_region is None and trained(site))

    for pair in expert_mlps([decision.site for decision in decisions]):
        mlp = [decision_of[id(site)] for site in pair]
        if not all(map(pooled, mlp)) or not all(isinstance(site.M, int) for site in pair):  # symbolic: a string
            continue
        gemms = [ExpertGemm(site.M, site.experts, out_features=site.N, in_features=site.K,
                            per_tensor=not decision.recipe.tiled) for site, decision in zip(pair, mlp)]
        for site, gemm, kept in zip(pair, gemms, weight_copies_kept(gemms, FP8_GEMM_DIM_MULTIPLE)):
            site.pooled_weight_copy = kept and not weight_copy_fits(gemm, FP8_GEMM_DIM_MULTIPLE)


def mark_gates(sites) -> None:
    """Set ``site.gate`` on routers and shared-expert gates (see the module's doc), whatever else keeps them
    (DeepSeek-V3's router multiplies ``weight.type(torch.float32)``, a weight computed in the graph)."""
    gemms = {site.node for site in sites}
    for site in sites:
        if isinstance(site, ExpertSite) or site.node.op not in ("call_function", "call_method"):
            continue
        if _reaches(site.node, _TOPK, _ROUTER_HOPS, gemms):
            site.gate = ("MoE router: its output picks each token's experts (topk), and FP8 error flips routing "
                         "decisions")
        elif site.N == 1 and _reaches(site.node, _SIGMOID, 2, gemms):
            site.gate = ("shared-expert gate: its sigmoid weighs the shared expert's output, and FP8 error moves "
                         "that weight for every token")
