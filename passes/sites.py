"""What a site of the graph is: one GEMM, of one of five kinds, each a class.

    Site                   where a GEMM is and its shape; the kinds below add their operands
    ├── LinearSite         input @ weight^T + bias, the weight a parameter (2-D)
    │   ├── FusedCallSite  a weight's GEMM inside one fused call (attention fast paths): listed, always kept
    │   └── ExpertSite     E GEMMs of a 3-D expert weight (E, N, K)
    │       ├── GroupedExpertSite   each over its group of sorted tokens (grouped_mm), or E groups of T (bmm)
    │       └── GatheredExpertSite  each token row by the weight of its expert, W[expert_ids] (MoE decode)
    └── MatmulSite         two activations (attention scores): no weight, FP8 only when a rule names it

``find_sites`` reads each GEMM node into one of these; every later pass asks the site's class what it is
(``isinstance``, or the class attributes :attr:`Site.form` and :attr:`Site.has_weight`) and never reads the
kind from which operands happen to be ``None``. A site that can never run in FP8 carries a ``blocker``;
its operands may then be partly unknown (a linear whose weight is computed in the graph is a
:class:`MatmulSite`: its right operand is an activation).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch
import torch.fx

from fp8graph.recipes.policy import SiteInfo

__all__ = ["REPLACEABLE_DTYPES", "ExpertSite", "FusedCallSite", "GatheredExpertSite", "GroupedExpertSite", "LinearSite",
           "MatmulSite", "Site"]

# The dtypes a site may be in to run in FP8; float64 and the rest stay as they are (passes.annotate).
REPLACEABLE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclasses.dataclass
class Site:
    """One GEMM of the graph: its node, the module that runs it, its shape and why it must stay (``blocker``).

    ``M`` is a string when the token dimension is symbolic (``dynamic=True``). A site inside a subgraph (a
    ``torch.utils.checkpoint`` body) records its ``graph_module`` and the ``checkpoint_region``.
    """

    # How its GEMMs run, as fp8graph.gemm.scaled_gemm.choose_lowering names the forms.
    form: ClassVar[str] = "linear"
    # Whether one operand is a weight parameter (what policies call a linear: SiteInfo.is_linear).
    has_weight: ClassVar[bool] = True

    node: torch.fx.Node
    op: str
    path: str
    module_type: type | None = None
    input_node: torch.fx.Node | None = None  # the left operand: the activation
    bias_node: torch.fx.Node | None = None  # the added term (a bias; addmm's and baddbmm's input)
    M: int | str | None = None
    K: int | None = None
    N: int | None = None
    dtype: torch.dtype | None = None
    blocker: str | None = None
    graph_module: torch.fx.GraphModule | None = None
    in_subgraph: bool = False
    checkpoint_region: torch.fx.GraphModule | None = None  # body of the enclosing torch.utils.checkpoint
    # The linear sites of its graph and checkpoint region that read its input, itself included (find_sites):
    # one cast of the input serves all of them (passes.group_sites), each charged its share by the cost model.
    input_readers: int = 1

    # A router or shared-expert gate: why only a rule naming it moves it to FP8 (passes.expert_sites.mark_gates;
    # DeepSeek-V3's router is a matmul site, its weight cast in the graph).
    gate: str | None = None
    # E of an expert site, whose kind makes it a field.
    experts: ClassVar[int | None] = None

    @property
    def info(self) -> SiteInfo:
        """What a policy rule sees of the site besides its module."""
        return SiteInfo(op=self.op, M=self.M, K=self.K, N=self.N, dtype=self.dtype, is_linear=self.has_weight,
                        experts=self.experts, gate=self.gate is not None, input_readers=self.input_readers)

    def with_operands(self, replaced: dict[torch.fx.Node, torch.fx.Node]) -> "Site":
        """A copy whose operands (not its own node) replaced since it was read are looked up in ``replaced``."""
        changes = {field.name: replaced[value] for field in dataclasses.fields(self)
                   if field.name != "node" and isinstance(value := getattr(self, field.name), torch.fx.Node)
                   and value in replaced}
        return dataclasses.replace(self, **changes)


@dataclasses.dataclass
class LinearSite(Site):
    """``input @ weight^T + bias`` with ``weight`` a parameter, stored (N, K), or (K, N) with ``weight_is_kn``
    (GPT-2's Conv1D): the rewrite then feeds ``weight.t()`` to the FP8 linear. ``weight_node`` is None only
    for a site with a ``blocker`` whose weight is not a node of the graph (a fused call's)."""

    weight_node: torch.fx.Node | None = None
    weight_is_kn: bool = False
    weight_input: torch.fx.Node | None = None  # the top-level placeholder the weight arrives through


@dataclasses.dataclass
class FusedCallSite(LinearSite):
    """A GEMM a fused call runs inside itself (``torch._native_multi_head_attention``, an
    ``F.multi_head_attention_forward`` left closed, ...), named by the child module owning the weight; its
    ``blocker`` says why it stays and how to open the call. ``node`` is the call."""


@dataclasses.dataclass
class ExpertSite(LinearSite):
    """E GEMMs of a 3-D expert weight, (E, N, K) or with ``weight_is_kn`` (E, K, N); never a gate."""

    experts: int | None = None


@dataclasses.dataclass
class GroupedExpertSite(ExpertSite):
    """Each expert's GEMM over its group of the sorted tokens (``grouped_mm``, groups ending at
    ``offsets_node``), or, with no offsets, over E groups of T tokens (``bmm`` of (E, T, K): Llama-4). When its
    input is a row gather only it reads, ``gather_source[gather_index]``, the rewrite casts the source rows and
    gathers FP8 bytes. When only SwiGLU reads its output, ``swiglu_nodes`` are the nodes from the output's
    ``chunk`` to ``silu(gate) * up``, the last one's value what the rewrite's call may return instead. When only
    the experts' combine reads it, ``combine_nodes`` are the nodes from the product by ``combine_weights`` (S, 1)
    to each token's sum of its ``combine_top_k`` rows, the tokens' order restored by the inverse of
    ``combine_permutation``: the last one's value what the call may return instead."""

    form: ClassVar[str] = "grouped"

    offsets_node: torch.fx.Node | None = None
    gather_source: torch.fx.Node | None = None
    gather_index: torch.fx.Node | None = None
    swiglu_nodes: tuple[torch.fx.Node, ...] = ()
    combine_nodes: tuple[torch.fx.Node, ...] = ()
    combine_weights: torch.fx.Node | None = None
    combine_permutation: torch.fx.Node | None = None
    combine_top_k: int = 0
    # Which GEMM of an expert MLP the site is, where the graph has both as the site model's stage table measured
    # them (passes.expert_sites.pair_expert_stages): 0 the first, 1 the second; None elsewhere.
    expert_stage: int | None = None
    # Kept its weight's copy for grad_input from the forward only because the expert MLP's two inputs pay for it
    # (passes.expert_sites.pool_weight_copies, after the decisions).
    pooled_weight_copy: bool = False

    @property
    def info(self) -> SiteInfo:
        """:class:`Site`'s, with the GEMM's place in the expert MLP (the site model prices each place's casts
        apart: ``fp8graph.costs.casts.GROUPED_STAGE_CAST_TRAFFIC``)."""
        return dataclasses.replace(super().info, expert_stage=self.expert_stage)


@dataclasses.dataclass
class GatheredExpertSite(ExpertSite):
    """Row s multiplies expert ``expert_ids[s]``'s weight (``bmm(W[expert_ids], x)``: MoE decode); FP8 only
    with frozen weights."""

    form: ClassVar[str] = "gathered"

    expert_ids_node: torch.fx.Node | None = None


@dataclasses.dataclass
class MatmulSite(Site):
    """A matmul of two activations, ``input_node @ other_node`` (attention scores), or a linear whose weight is
    computed in the graph (kept, with the ``blocker``). No cuBLAS FP8 GEMM is batched: it runs emulated."""

    form: ClassVar[str] = "batched"
    has_weight: ClassVar[bool] = False

    other_node: torch.fx.Node | None = None
