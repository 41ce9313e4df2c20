"""Recipe state (delayed scaling) as buffers of the modules that own the sites.

``fp8graph.compile`` calls :func:`register_delayed_state` before anything is
traced. For every module (the root included) whose 2-D weight the policy
gives a ``DelayedScaling`` recipe it registers, per weight parameter ``<name>``::

    fp8graph_amax_history_<name>              (2: input, weight; amax_history_len)   zeros
    fp8graph_scale_<name>                     (2: input, weight)                     ones
    fp8graph_grad_output_amax_history_<name>  (1, amax_history_len)                  zeros
    fp8graph_grad_output_scale_<name>         (1,)                                   ones

and for experts' 3-D weights (E, N, K) a weight row per expert: forward buffers of 1 + E rows (the
input, then expert 0 to E - 1), the grad_output pair as above (``fp8graph.targets.grouped``)

so ``state_dict()`` and ``load_state_dict()`` carry them (a checkpoint
saved without them loads with fresh state and a logged notice; one saved
with the three roles in one buffer loads split; one whose history has
another length is refused, naming the buffer), and a forward hook that
passes them to an anchor. Dynamo inlines the hooks of the
modules it traces into, so the buffers become graph inputs; the backend
drops the anchors and hands each site its buffers, which the FP8 linear
updates in place when the call trains: grad mode on and the module that
calls the weight in training mode (``state_anchor``). An eval-mode module
(``state_read_anchor``) or a graph without gradients reads the scales and
leaves the state alone. Dynamo guards on both, so each combination is a
graph of its own.

The forward writes the first pair and the backward the second, never the
other's: a buffer the compiled forward writes reaches the backward as a
saved copy, which the backward would have to copy into a fresh buffer,
update and copy back (four small kernels per weight and step), and which
a second forward before the backward would make stale.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from fp8graph.buffers.anchors import AnchorHook, NewBuffer, register_new_buffers
from fp8graph.numerics.formats import Role
from fp8graph.recipes.plan import Plan, looked_up_or_convolved
from fp8graph.recipes.policy import Policy, weight_experts
from fp8graph.recipes.scaling import misaligned

__all__ = ["FORWARD_ROLES", "GRAD_HISTORY_PREFIX", "GRAD_SCALE_PREFIX", "HISTORY_PREFIX", "SCALE_PREFIX",
           "STATE_PREFIXES", "DelayedState", "SiteState", "forward_rows",
           "register_delayed_state", "weight_candidates"]

log = logging.getLogger("fp8graph")

HISTORY_PREFIX = "fp8graph_amax_history_"
SCALE_PREFIX = "fp8graph_scale_"
GRAD_HISTORY_PREFIX = "fp8graph_grad_output_amax_history_"
GRAD_SCALE_PREFIX = "fp8graph_grad_output_scale_"
STATE_PREFIXES = (HISTORY_PREFIX, SCALE_PREFIX, GRAD_HISTORY_PREFIX, GRAD_SCALE_PREFIX)
# Rows of the forward buffers; the grad_output buffers have one.
FORWARD_ROLES = (Role.INPUT, Role.WEIGHT)


@dataclasses.dataclass(frozen=True)
class SiteState:
    """Where the state of one weight lives: the module that owns the weight, and the buffer names."""

    module: torch.nn.Module
    param_name: str

    @property
    def history(self) -> torch.Tensor:
        return getattr(self.module, HISTORY_PREFIX + self.param_name)

    def buffers(self) -> tuple[torch.Tensor, ...]:
        """``(history, scale, grad_history, grad_scale)`` (:data:`STATE_PREFIXES`' order), the order the graph
        targets take them in."""
        return tuple(getattr(self.module, prefix + self.param_name) for prefix in STATE_PREFIXES)


def _split_three_role_state(module: torch.nn.Module, state_dict, prefix) -> None:
    """A checkpoint that keeps the three roles in one buffer ((3, len) and (3,), as fp8graph saved them
    before the grad_output pair had buffers of its own) loads split: rows input and weight, then
    grad_output. Entries of any other shape are left for ``load_state_dict`` to refuse."""
    for name, _ in module.named_buffers(recurse=False):
        for forward_prefix, grad_prefix in ((HISTORY_PREFIX, GRAD_HISTORY_PREFIX), (SCALE_PREFIX, GRAD_SCALE_PREFIX)):
            if not name.startswith(forward_prefix):
                continue
            key, grad_key = prefix + name, prefix + grad_prefix + name[len(forward_prefix):]
            saved = state_dict.get(key)
            if saved is None or grad_key in state_dict or saved.dim() == 0 or saved.shape[0] != 3:
                continue
            state_dict[key], state_dict[grad_key] = saved[:2].clone(), saved[2:].clone()
            log.info("fp8graph: %s holds the three roles in one buffer; loading it as %s and %s", key, key, grad_key)


def _fill_missing_state(module: torch.nn.Module, state_dict, prefix, *args) -> None:
    """Load-state-dict pre-hook: a checkpoint that holds a weight but not its FP8 state (one saved without
    fp8graph) starts that weight's histories fresh. One that does not hold the weight (a partial load: an
    adapter's weights, one layer) leaves its state as it is, and ``load_state_dict`` names what is missing."""
    _split_three_role_state(module, state_dict, prefix)
    for name, buffer in module.named_buffers(recurse=False):
        state_prefix = max((p for p in STATE_PREFIXES if name.startswith(p)), key=len, default=None)
        if state_prefix is None or prefix + name in state_dict \
                or prefix + name[len(state_prefix):] not in state_dict:
            continue
        is_scale = name.startswith((SCALE_PREFIX, GRAD_SCALE_PREFIX))
        state_dict[prefix + name] = torch.ones_like(buffer) if is_scale else torch.zeros_like(buffer)
        log.info("fp8graph: checkpoint has no %s%s; starting a fresh %s", prefix, name,
                 "scale (1)" if is_scale else "amax history (zeros)")


def weight_candidates(module: torch.nn.Module):
    """The weights of ``module`` an FP8 site may multiply: matrices, and experts' 3-D weights (E, N, K)."""
    if looked_up_or_convolved(module):
        return
    for name, param in module.named_parameters(recurse=False):
        # FP8 GEMMs need both dims of the matrix to be multiples of 16, whichever
        # way round it is stored; other weights stay in high precision anyway.
        if param.dim() in (2, 3) and param.is_floating_point() \
                and misaligned(None, rows=param.shape[-2], columns=param.shape[-1]) is None:
            yield name, param


def forward_rows(param: torch.Tensor) -> int:
    """Rows of a weight's forward state: input and weight, or input and one per expert of a 3-D weight."""
    experts = weight_experts(param)
    return 1 + (1 if experts is None else experts)


def _state_names(owner: torch.nn.Module) -> list[str]:
    return [name for name, _ in owner.named_buffers(recurse=False) if name.startswith(STATE_PREFIXES)]


class _StateHook(AnchorHook):
    """Anchors delayed-scaling state as updated by this call, or, from a module in eval mode, as only read."""

    def __init__(self, sources) -> None:
        super().__init__("state", sources)

    def anchor_kind(self, module: torch.nn.Module) -> str:
        return "state" if module.training else "state_read"


class DelayedState:
    """Every registered :class:`SiteState`, found by the weight tensor a graph multiplies."""

    def __init__(self) -> None:
        # (module, parameter name, state): a tied weight appears under each of its names.
        self._holders: list[tuple[torch.nn.Module, str, SiteState]] = []

    def add(self, module: torch.nn.Module, param_name: str, site_state: SiteState) -> None:
        self._holders.append((module, param_name, site_state))

    def by_weight(self) -> dict[int, SiteState]:
        """``{id(weight): SiteState}`` for the tensors the owning modules hold now."""
        return {id(module._parameters[name]): site_state for module, name, site_state in self._holders
                if module._parameters.get(name) is not None}


_REGISTERED_ATTRIBUTE = "_fp8graph_delayed_state"


def _reuse_registered_state(model: torch.nn.Module, plan: Plan, delayed_state: DelayedState) -> DelayedState:
    """The state an earlier ``fp8graph.compile`` registered, if it serves ``policy`` as it is.

    Compiling a model again (for inference with ``freeze_weights``, with
    another compiler) keeps training's histories and scales, and the hooks
    that anchor them. A policy that wants state for another weight, or
    another history length, is refused.
    """
    by_weight = delayed_state.by_weight()
    for path, module in model.named_modules():
        for name, param in weight_candidates(module):
            recipe = plan[param].delayed
            site_state = by_weight.get(id(param))
            if recipe is None or (site_state is not None and
                                  site_state.history.shape[1] == recipe.amax_history_len):
                continue
            there = "none" if site_state is None else f"a history of length {site_state.history.shape[1]}"
            raise ValueError(
                f"{path or '<root>'}.{name}: the model was compiled before, and its delayed-scaling state "
                f"cannot serve this policy (a history of length {recipe.amax_history_len} is asked for; "
                f"there is {there}). Compile it with the first policy again, or build a fresh model")
    return delayed_state


def register_delayed_state(model: torch.nn.Module, policy: Policy, plan: Plan | None = None) -> DelayedState:
    """Register state for every weight the policy gives delayed scaling.

    A weight has one state wherever it is used (a module called twice, a
    functional call on a submodule's weight, a weight tied to another
    module's). The root module's own weights keep their state on the root;
    Dynamo runs the root's hooks outside the graph, so every submodule's
    forward hook anchors it. A model compiled before keeps the state of its
    first compile (see :func:`_reuse_registered_state`). ``plan``: the model's plan under ``policy``
    (``fp8graph.compile`` passes the one every subsystem reads; made here when ``None``).
    """
    plan = plan if plan is not None else Plan(model, policy)
    earlier = model.__dict__.get(_REGISTERED_ATTRIBUTE)
    if earlier is not None:
        return _reuse_registered_state(model, plan, earlier)
    registered: dict[int, SiteState] = {}
    delayed_state = DelayedState()
    new_buffers: list[NewBuffer] = []
    owners = []
    tied_holders: dict[torch.nn.Module, list[torch.nn.Module]] = {}  # module -> owners of its tied weights
    for path, module in model.named_modules():
        names = []
        for name, param in weight_candidates(module):
            if id(param) in registered:  # a tied weight: one state, kept by the first module
                delayed_state.add(module, name, registered[id(param)])
                tied_holders.setdefault(module, []).append(registered[id(param)].module)
                continue
            recipe = plan[param].delayed
            if recipe is None:
                continue
            history_len, device = recipe.amax_history_len, param.device
            rows = forward_rows(param)
            for prefix, initial in ((HISTORY_PREFIX, torch.zeros(rows, history_len, device=device)),
                                    (SCALE_PREFIX, torch.ones(rows, device=device)),
                                    (GRAD_HISTORY_PREFIX, torch.zeros(1, history_len, device=device)),
                                    (GRAD_SCALE_PREFIX, torch.ones(1, device=device))):
                new_buffers.append(NewBuffer(module, path, prefix + name, initial, persistent=True))
            registered[id(param)] = SiteState(module, name)
            delayed_state.add(module, name, registered[id(param)])
            names.append(name)
        if names:
            owners.append(module)
    register_new_buffers(new_buffers, if_taken="not from an earlier fp8graph.compile of this model: build a "
                                                "fresh model")
    for module in owners:
        module._register_load_state_dict_pre_hook(_fill_missing_state, with_module=True)
        if module is not model:
            module.register_forward_hook(_StateHook([(module, _state_names(module))]))
    for module, weight_owners in tied_holders.items():
        if module is not model:  # the owner's buffers must reach a graph that only calls this module
            module.register_forward_hook(_StateHook([(owner, _state_names(owner)) for owner in weight_owners]))
    if model in owners:
        anchor_root = _StateHook([(model, _state_names(model))])
        for submodule in model.modules():
            if submodule is not model:
                submodule.register_forward_hook(anchor_root)
        if next(model.children(), None) is None:  # a bare module: fp8graph.compile traces its own hooks
            model.register_forward_hook(anchor_root)
    model.__dict__[_REGISTERED_ATTRIBUTE] = delayed_state
    return delayed_state
