"""Every module instance runs its own decisions, also where Dynamo compiles one frame for many instances.

Dynamo compiles a frame per code object, guarded on what the trace read. A module whose forward breaks
the graph (``.tolist()``, ``.item()``, ``print``) is compiled as a frame of its own, ``L['self']`` being
whichever instance called it first; with nn modules inlined, its weights are graph inputs, so another
instance of the class passes the same guards and runs the graph compiled for the first, with the first
one's decisions. A policy that keeps the first and last layers in high precision would then be silently
not honoured.

So each graph the backend compiles gets one more guard per module its weights are read through: that
module's plan signature (``fp8graph.recipes.plan.Plan.signature``: what the policy gives its subtree, relative to
it) equals the traced instance's. Instances with equal signatures still share the graph; an instance the
policy treats differently fails the guard and gets a graph of its own, decided for its own paths. The
signature lives on each module as an attribute named for the backend (two compiles of one model with
different policies keep theirs apart); guards read it with Dynamo's own attribute and equality guards.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
import weakref

import torch
import torch.fx
from torch._dynamo.guards import GuardBuilder
from torch._dynamo.source import AttrSource

from fp8graph.passes.pipeline import parameter_owners
from fp8graph.recipes.plan import instance_path

__all__ = ["InstanceSignatures", "served_decisions"]

_TOKENS = itertools.count()
_BY_PLAN: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
# A weight read through modules from a frame's local or global: L['self']._modules['mlp']._parameters['weight']
_WEIGHT_SOURCE = re.compile(r"^(?P<root>[LG]\[['\"][^'\"]+['\"]\])(?P<chain>(?:\._modules\[['\"][^'\"]+['\"]\])*)"
                            r"\._parameters\[['\"][^'\"]+['\"]\]$")
_MODULE_NAME = re.compile(r"\._modules\[['\"]([^'\"]+)['\"]\]")


def _root_source(source):
    while getattr(source, "base", None) is not None:
        source = source.base
    return source


class InstanceSignatures:
    """Writes each module's plan signature onto it, and guards each compiled graph on the ones it read."""

    @classmethod
    def of(cls, model: torch.nn.Module, plan) -> "InstanceSignatures":
        """The signatures of ``model`` under ``plan``, written once however many backends share the plan."""
        if plan not in _BY_PLAN:
            _BY_PLAN[plan] = cls(model, plan)
        return _BY_PLAN[plan]

    def __init__(self, model: torch.nn.Module, plan):
        """``plan``: the model's :class:`fp8graph.recipes.plan.Plan`; each module gets its ``signature(path)``."""
        self.attribute = f"_fp8graph_plan_{next(_TOKENS)}"
        self._modules = dict(model.named_modules())
        # A weight two modules share is owned by the first, as the passes name it.
        self._owners = {key: path for key, (path, _) in parameter_owners(self._modules).items()}
        for path, module in self._modules.items():
            module.__dict__[self.attribute] = plan.signature(path)

    def roots(self, gm: torch.fx.GraphModule, value_of: dict) -> dict[str, object]:
        """``{path: Dynamo source}`` of each module of the model that ``gm``'s weights are read through from
        its frame's local or global (``L['self']``: the instance the frame was traced for)."""
        guarded: dict[str, object] = {}
        for node in gm.graph.find_nodes(op="placeholder"):
            source = getattr(node.meta.get("grapharg"), "source", None)
            weight = value_of.get(node)
            if source is None or id(weight) not in self._owners:
                continue
            name = source.name if isinstance(source.name, str) else source.name()
            match = _WEIGHT_SOURCE.match(name)
            if match is None:
                continue
            relative = ".".join(_MODULE_NAME.findall(match["chain"]))
            owner = self._owners[id(weight)]
            if relative and not (owner == relative or owner.endswith("." + relative)):
                continue
            root_path = owner[:len(owner) - len(relative)].rstrip(".") if relative else owner
            if root_path not in self._modules or root_path in guarded:
                continue
            guarded[root_path] = _root_source(source)
        return guarded

    def guard(self, roots: dict[str, object]) -> None:
        """Guard the graph Dynamo is compiling on the plan signature of each of ``roots``."""
        context = torch._guards.TracingContext.try_get()
        for root in roots.values():
            context.guards_context.dynamo_guards.add(
                AttrSource(root, self.attribute).make_guard(GuardBuilder.EQUALS_MATCH))

    def alike(self, path: str) -> list[str]:
        """The other instances the frame traced for the module at ``path`` serves: modules of its class with its
        plan signature (every instance of a class whose forward breaks the graph runs that frame)."""
        module = self._modules[path]
        signature = module.__dict__[self.attribute]
        return [other_path for other_path, other in self._modules.items()
                if other_path != path and type(other) is type(module) and other.__dict__[self.attribute] == signature]


def served_decisions(decisions: list, traced: str, instance: str, plan) -> list:
    """``decisions`` of the instance at ``traced`` as the ones its frame takes for the instance at ``instance``:
    each site moved to the instance's path, and joined to the instance's own weight in ``plan``."""
    served = []
    for decision in decisions:
        path = instance_path(decision.site.path, traced, instance)
        if path is None:
            continue
        planned = decision.planned
        if planned is not None:
            weight_path = instance_path(planned.path, traced, instance)
            planned = (plan.named(weight_path, planned.name) if weight_path is not None else None) or planned
        served.append(dataclasses.replace(decision, site=dataclasses.replace(decision.site, path=path), planned=planned))
    return served
