"""Find a model's repeated blocks and group their instances by what the policy gives them.

A transformer is one layer N times. Compiled as one graph, every layer is
traced, rewritten and compiled again; compiled per block, the first
instance's code serves all the others, because parameters and buffers are
graph inputs (see :mod:`fp8graph.regions.regional_compile`). This module only
decides *what* the blocks are:

- ``regions="auto"`` (the default of :func:`fp8graph.compile`): the classes a
  HuggingFace model names in ``_no_split_modules`` (its decoder or encoder
  layer), else the children of any ``nn.ModuleList`` whose entries share one
  class; a class with fewer than two instances is no block.
- ``regions=[LlamaDecoderLayer, "model.layers.*"]``: classes, or glob
  patterns over module paths; each entry must match a module.
- ``regions=None``: one graph for the whole model, as ``torch.compile`` does.

Blocks nest in no other block (the outermost match wins) and are never the
root. Instances of one class share compiled code only when the policy gives
them the same recipes: :func:`group_blocks` keys each instance by the
resolution of every weight it holds, relative to the block, so a rule like
``("model.layers.0.*", None)`` puts layer 0 in a group of its own. The
signature sees weights before tracing (the token count ``M`` is unknown);
``fp8graph.regions.regional_compile`` checks each compiled site again with its
traced shape and refuses a policy that tells instances of one group apart.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from typing import Iterable

import torch

from fp8graph.recipes.plan import Plan
from fp8graph.buffers.delayed_state import weight_candidates

__all__ = ["BlockGroup", "find_blocks", "find_trunks", "group_blocks", "is_auto", "trunk_parts"]

AUTO = "auto"


@dataclasses.dataclass
class BlockGroup:
    """Instances of one block class that the policy treats alike; they share one compiled region.

    ``paths[0]`` is the template: the instance whose module paths the
    compiled graph's sites carry.
    """

    block_type: type
    paths: list[str]
    modules: list[torch.nn.Module]

    @property
    def template(self) -> str:
        return self.paths[0]


def _class_names(module: torch.nn.Module) -> set[str]:
    # FSDP2's fully_shard makes the class a subclass (FSDPLlamaDecoderLayer): match the whole MRO.
    return {cls.__name__ for cls in type(module).__mro__}


def _outermost(blocks: list[tuple[str, torch.nn.Module]]) -> list[tuple[str, torch.nn.Module]]:
    kept: list[tuple[str, torch.nn.Module]] = []
    for path, module in blocks:  # named_modules order: a parent comes before its children
        if not any(path.startswith(outer + ".") for outer, _ in kept):
            kept.append((path, module))
    return kept


def _repeated(blocks: list[tuple[str, torch.nn.Module]]) -> list[tuple[str, torch.nn.Module]]:
    count: dict[type, int] = {}
    for _, module in blocks:
        count[type(module)] = count.get(type(module), 0) + 1
    return [(path, module) for path, module in blocks if count[type(module)] >= 2]


def _has_submodules(module: torch.nn.Module) -> bool:
    return next(module.children(), None) is not None


def _auto_blocks(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    no_split = set(getattr(model, "_no_split_modules", None) or ())
    if no_split:
        named = [(path, module) for path, module in model.named_modules()
                 if path and _class_names(module) & no_split]
        return _repeated(_outermost(named))
    listed = []
    for path, module in model.named_modules():
        if not isinstance(module, torch.nn.ModuleList) or len(module) < 2:
            continue
        children = list(module.named_children())
        # A list of bare Linears is no block worth a region of its own: nothing to fuse around the GEMM.
        if len({type(child) for _, child in children}) == 1 and _has_submodules(children[0][1]):
            listed += [(f"{path}.{name}" if path else name, child) for name, child in children]
    return _repeated(_outermost(listed))


def _explicit_blocks(model: torch.nn.Module, regions: Iterable[object]) -> list[tuple[str, torch.nn.Module]]:
    entries = list(regions)
    named = [(path, module) for path, module in model.named_modules() if path]
    chosen, matched = [], set()
    for index, entry in enumerate(entries):
        if isinstance(entry, type) and issubclass(entry, torch.nn.Module):
            hits = [(p, m) for p, m in named if isinstance(m, entry)]
        elif isinstance(entry, str):
            hits = [(p, m) for p, m in named if fnmatch.fnmatchcase(p, entry)]
        else:
            raise ValueError(f"regions[{index}] must be an nn.Module subclass or a glob over module paths, "
                             f"got {entry!r}")
        if not hits:
            what = entry.__name__ if isinstance(entry, type) else repr(entry)
            raise ValueError(f"fp8graph: regions[{index}] ({what}) matches no submodule of "
                             f"{type(model).__name__}")
        matched.update(p for p, _ in hits)
    chosen = [(p, m) for p, m in named if p in matched]
    return _outermost(chosen)


def is_auto(regions: object) -> bool:
    """Whether ``regions`` asks for the blocks found by themselves (:data:`AUTO`)."""
    return isinstance(regions, str) and regions == AUTO


def find_blocks(model: torch.nn.Module, regions: object = AUTO) -> list[tuple[str, torch.nn.Module]]:
    """``(path, module)`` of every block instance ``regions`` selects in ``model``, in module order."""
    if regions is None or regions is False:
        return []
    if is_auto(regions):
        return _auto_blocks(model)
    if not isinstance(regions, (list, tuple)):
        raise ValueError(f"regions must be 'auto', None, or a list of classes and path globs, got {regions!r}")
    return _explicit_blocks(model, regions)


def group_blocks(blocks: list[tuple[str, torch.nn.Module]], plan: Plan) -> list[BlockGroup]:
    """Instances grouped by class and plan signature (what the policy gives their weights, relative to each),
    in the order their first instance appears."""
    keyed: list[tuple[tuple, BlockGroup]] = []
    for path, module in blocks:
        key = (type(module), plan.signature(path))
        for other_key, group in keyed:
            if other_key == key:
                group.paths.append(path)
                group.modules.append(module)
                break
        else:
            keyed.append((key, BlockGroup(type(module), [path], [module])))
    return [group for _, group in keyed]



_CONTAINERS = (torch.nn.ModuleList, torch.nn.Sequential, torch.nn.ModuleDict)


def find_trunks(model: torch.nn.Module, blocks: list[tuple[str, torch.nn.Module]],
                plan: Plan) -> list[tuple[str, torch.nn.Module]]:
    """The modules that call the blocks (HuggingFace's ``model.model``), where they can run eagerly.

    Between its block calls a trunk runs the embedding, the rotary tables,
    the attention mask and the final norm: no GEMM, a few launches. Traced,
    it would be cut at every block call; worse, HuggingFace builds the
    attention mask differently under tracing (a padded or packed-sequence
    mask it cannot rule out, which takes scaled_dot_product_attention off
    its causal fast path). So a trunk runs eagerly around the compiled
    regions, unless it owns a weight the policy gives a recipe outside its
    blocks (that site would lose FP8), or it is the root (which holds the
    head and the loss, compiled by the root's backend).
    """
    block_paths = [path for path, _ in blocks]
    modules = dict(model.named_modules())
    trunks: dict[str, torch.nn.Module] = {}
    for path in block_paths:
        parent = path.rsplit(".", 1)[0] if "." in path else ""
        if parent and isinstance(modules[parent], _CONTAINERS):
            parent = parent.rsplit(".", 1)[0] if "." in parent else ""
        if parent:
            trunks.setdefault(parent, modules[parent])

    def inside_a_block(path):
        return any(path == block or path.startswith(block + ".") for block in block_paths)

    def owns_fp8_sites(trunk_path, trunk):
        for relative, module in trunk.named_modules():
            full = f"{trunk_path}.{relative}" if relative else trunk_path
            if inside_a_block(full):
                continue
            for _, param in weight_candidates(module):
                if plan.recipes(param).recipes != (None,):
                    return True
        return False

    return [(path, trunk) for path, trunk in trunks.items() if not owns_fp8_sites(path, trunk)]


def trunk_parts(trunks: list[tuple[str, torch.nn.Module]],
                blocks: list[tuple[str, torch.nn.Module]]) -> list[tuple[str, torch.nn.Module]]:
    """The trunks' children that hold parameters (embedding, final norm), each compiled as a region of its own.

    Run eagerly they would keep what eager PyTorch keeps for backward (an
    RMSNorm's float32 upcast); compiled, Inductor fuses them as it would in
    the whole model. Children without parameters (rotary tables, dropout)
    stay eager; block containers are left to their blocks.
    """
    block_paths = {path for path, _ in blocks}
    parts = []
    for trunk_path, trunk in trunks:
        for name, child in trunk.named_children():
            path = f"{trunk_path}.{name}"
            holds_blocks = any(block == path or block.startswith(path + ".") for block in block_paths)
            if not holds_blocks and next(child.parameters(), None) is not None:
                parts.append((path, child))
    return parts
