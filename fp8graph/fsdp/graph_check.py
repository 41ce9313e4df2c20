"""A weight FSDP2 gathered in FP8 is read by FP8 sites only: checked on every rewritten graph.

Its gathered value holds FP8 bytes, not the weight (``fp8graph.fsdp.gathered_weight``). A site the backend
keeps in high precision, or any other op on it, would compute with the dequantized FP8 weight: a silent
change of what the model computes. The FP8 gather is decided per weight before tracing
(``fp8graph.fsdp.install``); if a traced graph disagrees, compiling it fails here, naming the weight and why.
"""

from __future__ import annotations

import torch.fx

from fp8graph.fsdp.gathered_weight import is_gathered

__all__ = ["check_gathered_weights"]


def _reads_gathered_weights(node: torch.fx.Node) -> bool:
    """Whether ``node`` calls an FP8 target that reads a gathered weight's bytes (the linears' targets)."""
    return node.op == "call_function" and getattr(node.target, "reads_gathered_weights", False)


def check_gathered_weights(gm: torch.fx.GraphModule, value_of: dict, decisions) -> None:
    """Raise unless every user of every gathered weight in ``gm`` (after the rewrite) is an FP8 target that
    reads it."""
    kept = {d.site.weight_input: d for d in decisions if not d.rewritten and d.site.has_weight}
    for node in gm.graph.find_nodes(op="placeholder"):
        if not is_gathered(value_of.get(node)):  # the real parameter, or its example
            continue
        for user in node.users:
            if _reads_gathered_weights(user):
                continue
            decision = kept.get(node)
            why = (f"its site {decision.site.path} stays in high precision: {decision.reason}" if decision is not None
                   else f"it is read by {user.format_node()}")
            raise RuntimeError(
                f"fp8graph: the weight {node.name} was all-gathered in FP8 under FSDP2, but {why}. Keep the "
                "module in high precision in the policy (its weight is then gathered in high precision), or "
                "compile with fp8_all_gather=False")
