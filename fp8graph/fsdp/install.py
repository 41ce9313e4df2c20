"""Which weights of a ``fully_shard``-ed model FSDP2 all-gathers in FP8, and setting it up.

``fp8graph.compile`` calls :func:`install_fp8_all_gather` after the model is sharded. A weight is gathered in
FP8 when every site on it will be FP8 with one recipe that can cast its shard (``fp8graph.fsdp.shard_casts``:
current, delayed and row-wise scaling; block scaling and MXFP8 where each shard holds whole tile rows: 128
rows, 32 rows): decided from the policy before tracing, as delayed-scaling state is
(``fp8graph.recipes.plan.Plan``). Every other weight is gathered in high precision, and its
:class:`GatherRecord` says why; ``fp8graph.explain`` lists them. A weight gathered in FP8 that a traced
graph then reads outside an FP8 site is refused when the graph is compiled (``fp8graph.fsdp.graph_check``).

FSDP2's extension point is public (``fsdp_pre_all_gather`` / ``fsdp_post_all_gather`` on the local tensor);
attaching it to a parameter that ``fully_shard`` already set up is not: :func:`_attach` re-runs the
parameter's extension set-up and drops any buffers of an earlier high-precision gather (torch 2.11 to
2.13's ``FSDPParam``), and fails loudly if those internals differ.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from fp8graph.buffers.delayed_state import weight_candidates
from fp8graph.buffers.kept_casts import ReuseScope
from fp8graph.fsdp.shard_casts import (GatherCalls, ShardCast, TiledShardCast, WeightAmaxes, fp8_gathered_bytes,
                                      shard_row_multiple)
from fp8graph.recipes.plan import UNDECIDED, Plan, looked_up_or_convolved
from fp8graph.recipes.policy import Policy, weight_orientations
from fp8graph.recipes.scaling import misaligned

__all__ = ["AllGatherPlan", "GatherRecord", "fsdp_mesh", "install_fp8_all_gather"]

log = logging.getLogger("fp8graph")


@dataclasses.dataclass(frozen=True)
class GatherRecord:
    """How FSDP2 all-gathers one weight: ``fp8`` true with ``recipe``, or in high precision with ``reason``;
    the bytes of one gather of the whole weight in FP8 (scales included) and in high precision."""

    path: str  # "model.layers.0.self_attn.q_proj.weight"
    fp8: bool
    recipe: object = None
    reason: str | None = None
    fp8_bytes: int | None = None
    high_precision_bytes: int | None = None


@dataclasses.dataclass
class AllGatherPlan:
    """Every sharded weight's :class:`GatherRecord`, and what runs the FP8 gathers."""

    records: list[GatherRecord]
    amaxes: WeightAmaxes
    calls: GatherCalls
    casts: list[tuple[object, ShardCast | TiledShardCast]]  # (FSDPParam, its cast)
    model: torch.nn.Module
    first_call: bool = True

    def before_call(self) -> None:
        """Before each call of the compiled model: amaxes are reduced afresh, lost extensions re-attached
        (FSDP2 replaces a local tensor when a state dict is loaded with ``assign=True``). At the first call a
        model that was ``fully_shard``-ed only after compiling is reported: it gathers in high precision."""
        if self.first_call:
            self.first_call = False
            if not self.records and next(_param_groups(self.model), None) is not None:
                log.warning("fp8graph: %s was fully_shard-ed after fp8graph.compile: FSDP2 gathers its weights in "
                            "high precision. fully_shard first, then compile, to gather them in FP8",
                            type(self.model).__name__)
        self.amaxes.begin_call()
        self.calls.begin()
        for fsdp_param, cast in self.casts:
            if fsdp_param._sharded_local_tensor is not cast.local:
                cast.local = fsdp_param._sharded_local_tensor
                _attach(fsdp_param, cast)


def _param_groups(model: torch.nn.Module):
    """The FSDPParamGroup of each ``fully_shard`` unit of ``model`` that holds parameters, once (one ``fully_shard``
    of a list of modules makes them one unit: ``group.modules``)."""
    from torch.distributed.fsdp import FSDPModule

    seen = set()
    for module in model.modules():
        if isinstance(module, FSDPModule):
            group = module._get_fsdp_state()._fsdp_param_group
            if group is not None and id(group) not in seen:
                seen.add(id(group))
                yield group


def fsdp_mesh(model: torch.nn.Module):
    """The device mesh ``fully_shard`` shards ``model`` over (1-D, or HSDP's 2-D), or ``None`` if it is not."""
    group = next(_param_groups(model), None)
    return group.mesh_info.mesh if group is not None else None


def _forward_is_torch_nns(module: torch.nn.Module) -> bool:
    """Whether ``module``'s forward is ``torch.nn``'s code (a subclass that keeps ``nn.Linear``'s forward too)."""
    return getattr(type(module).forward, "__module__", "").startswith("torch.nn.")


def _runs_eagerly(unit_modules, module: torch.nn.Module, parents: dict) -> bool:
    """Whether Dynamo runs ``module``'s forward outside the compiled graphs: an FSDP2 unit's call breaks the graph
    that calls it, and ``torch.nn``'s code is not a frame Dynamo compiles on its own, so a module whose forward
    is, with every module's between it and its unit (one of ``unit_modules``), ``torch.nn``'s (``fully_shard``
    on an ``nn.Linear``, or on an ``nn.Sequential`` of them) runs eagerly. A user's forward on the way is
    compiled, and what it calls with it. ``parents``: ``{id(module): its parent}`` over the model."""
    units = {id(unit) for unit in unit_modules}
    while _forward_is_torch_nns(module):
        if id(module) in units:
            return True
        if id(module) not in parents:
            return False
        module = parents[id(module)]
    return False


def _reason_not_fp8(plan: Plan, module, param, fsdp_param, group, options: dict):
    """Why the weight is gathered in high precision, else ``None`` and the recipe."""
    if param.dim() != 2:
        return "not a matrix", None
    if looked_up_or_convolved(module):
        kind = type(module).__name__
        return f"{'an' if kind[0] in 'AEIOU' else 'a'} {kind}'s weight, not a GEMM's", None
    if not any(candidate is param for _, candidate in weight_candidates(module)):
        return f"shape {tuple(param.shape)}: {misaligned(None, N=param.shape[0], K=param.shape[1])}", None
    if fsdp_param._module_info.shared_modules:
        return "tied to another module's weight", None
    if weight_orientations(module, param) != [tuple(param.shape)]:
        return "its module may multiply it transposed: only nn.Linear weights (N, K) are gathered in FP8", None
    entry = plan[param]
    recipe = entry.decided
    if recipe is UNDECIDED:
        return (f"the policy decides its recipe only when the graph is traced "
                f"({', '.join(entry.recipes.undecided)})"), None
    if recipe is None:
        return "the policy keeps its sites in high precision", None
    shape_reason = misaligned(recipe, N=param.shape[0], K=param.shape[1])
    if shape_reason is not None:
        return f"shape {tuple(param.shape)}: {shape_reason}", None
    if options.get("stats"):
        return "stats=True measures each weight's cast inside the graph, from the high-precision weight", None
    if options.get("cache_weights"):
        return "cache_weights=True keeps an FP8 copy of the gathered weight instead", None
    if fsdp_param.offload_to_cpu:
        return "its shard is offloaded to the CPU", None
    if fsdp_param.is_dtensor:
        return "tensor-parallel (a DTensor inside FSDP2)", None
    if fsdp_param.fsdp_placement.dim != 0:
        return f"sharded on dim {fsdp_param.fsdp_placement.dim}, not on its rows", None
    ranks = fsdp_param.shard_mesh.size()
    if param.shape[0] % ranks:
        # FSDP2 pads the last shards; the casts would have to cover the padding rows (not done).
        return f"its {param.shape[0]} rows do not split evenly over {ranks} ranks", None
    if ranks == 1 and recipe.tiled:
        # FSDP2 copies one tensor per weight on a single rank (torch 2.11 to 2.13); nothing is sent anyway.
        return f"one rank: FSDP2 copies a single tensor per weight there, and {recipe.name} gathers scales too", None
    tile_rows = shard_row_multiple(recipe)
    if (param.shape[0] // ranks) % tile_rows:
        return (f"each of {ranks} ranks holds {param.shape[0] // ranks} of its rows, which splits its "
                f"{tile_rows}-row tiles"), None
    if group.post_forward_mesh_info not in (None, group.mesh_info):
        return "reshard_after_forward is an int: FSDP2 refuses all-gather extensions there", None
    return None, recipe


def install_fp8_all_gather(model: torch.nn.Module, policy: Policy, paths: dict[str, str],
                           options: dict, scope: ReuseScope, plan: Plan | None = None) -> AllGatherPlan:
    """Set up FP8 all-gathers for the weights of ``model`` that can take them; ``paths`` maps ``str(id(module))``
    to its path (``fp8graph.passes.module_paths.module_paths_by_id``). Returns the plan (no FSDP2 module: no
    records). ``scope``: the model's (``fp8graph.buffers.kept_casts``), inside which a shard's cast is sent again
    at the next calls. ``plan``: the model's plan under ``policy`` (made here when ``None``)."""
    plan = plan if plan is not None else Plan(model, policy)
    amaxes, calls = WeightAmaxes(), GatherCalls(scope)
    records, casts = [], []
    parents = {id(child): parent for parent in model.modules() for child in parent.children()}
    for group in _param_groups(model):
        for fsdp_param in group.fsdp_params:
            module, name = fsdp_param._module_info.module, fsdp_param._module_info.param_name
            module_path = paths.get(str(id(module)), "")
            path = f"{module_path}.{name}" if module_path else name
            param = getattr(module, name)
            reason, recipe = _reason_not_fp8(plan, module, param, fsdp_param, group, options)
            if reason is None and _runs_eagerly(group.modules, module, parents):
                reason, recipe = ("Dynamo runs its module eagerly: its forward, and every module's up to its FSDP2 "
                                  "unit, is torch.nn's code (shard a module of your own around it)"), None
            param_dtype = group.mp_policy.param_dtype or param.dtype  # what FSDP2 would gather
            high_precision_bytes = param.numel() * param_dtype.itemsize
            if reason is not None:
                records.append(GatherRecord(path, False, reason=reason, high_precision_bytes=high_precision_bytes))
                continue
            local = fsdp_param._sharded_local_tensor
            if recipe.tiled:
                cast = TiledShardCast(path, recipe, local, param_dtype, calls)
            else:
                cast = ShardCast(path, module, name, recipe, local, param_dtype, amaxes, calls)
                amaxes.add(cast, _process_group(fsdp_param))
            _attach(fsdp_param, cast)
            records.append(GatherRecord(path, True, recipe=recipe, fp8_bytes=fp8_gathered_bytes(*param.shape, recipe),
                                        high_precision_bytes=high_precision_bytes))
            casts.append((fsdp_param, cast))
    return AllGatherPlan(records, amaxes, calls, casts, model)


def _process_group(fsdp_param):
    mesh = fsdp_param.shard_mesh
    return mesh.get_group() if mesh.size() > 1 else None


def _attach(fsdp_param, cast: ShardCast) -> None:
    """Make FSDP2 gather ``fsdp_param`` through ``cast`` from its next all-gather on."""
    from torch.distributed.fsdp._fully_shard._fsdp_param import ShardedState

    missing = [name for name in ("_init_extensions", "all_gather_outputs", "sharded_state", "_sharded_local_tensor")
               if not hasattr(fsdp_param, name)]
    if missing:
        raise RuntimeError(f"{cast.path}: this torch's FSDP2 has no {', '.join(missing)}: FP8 all-gather is built "
                           f"for torch 2.11 to 2.13 ({torch.__version__} here); compile with fp8_all_gather=False")
    if fsdp_param.sharded_state != ShardedState.SHARDED:
        raise RuntimeError(f"{cast.path}: its module is unsharded now (inside a forward, or reshard_after_forward="
                           "False after a forward); compile the model between steps")
    local = cast.local
    local.fsdp_pre_all_gather = cast.fsdp_pre_all_gather
    local.fsdp_post_all_gather = cast.fsdp_post_all_gather
    fsdp_param._init_extensions()
    # A gather in high precision may have run already: its output buffers have the wrong size and dtype.
    fsdp_param.all_gather_outputs = []
    if hasattr(fsdp_param, "_unsharded_param"):
        del fsdp_param._unsharded_param
