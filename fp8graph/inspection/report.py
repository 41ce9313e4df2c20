"""What the fp8 backend decided for each site, as records and a readable table."""

from __future__ import annotations

import collections
import dataclasses
import io
import pathlib

import torch
from rich.console import Console
from rich.table import Table

from fp8graph.costs import GPU, SiteTimes, site_times
from fp8graph.passes.annotate import Decision
from fp8graph.recipes.policy import Policy, SiteInfo
from fp8graph.recipes.scaling import Recipe

__all__ = ["ExplainReport", "SiteRecord"]


@dataclasses.dataclass(frozen=True)
class SiteRecord:
    """One site: where it is, what a policy sees of it, and what fp8graph did with it.

    ``site`` is the site as policy rules see it (:class:`fp8graph.recipes.policy.SiteInfo`: op, GEMM shape,
    dtype, experts), derived from the traced site, and ``op``, ``M``, ``K``, ``N``, ``dtype`` and ``experts``
    read it. ``recipe`` is the recipe object when the site runs in FP8 (frozen and
    hashable: ``record.recipe == policy_recipe`` holds, rows filter by
    ``isinstance``; ``str`` gives the short name tables print), else ``None``
    and ``reason`` says why it stays in high precision. ``M`` is a string
    when the token dimension is symbolic (``dynamic=True``). ``experts`` is
    the number of experts of an expert site (op ``grouped_mm``), else ``None``.
    ``modelled`` is the site's modelled kernel time per training call on a GPU, in BF16 and in its recipe
    (a kept site: in the recipe the policy's default would give it), from :mod:`fp8graph.costs`; ``None``
    where nothing was modelled (no GEMM shape, a symbolic ``M``, or ``explain(..., gpu=None)``).
    """

    path: str
    site: SiteInfo
    recipe: Recipe | None
    reason: str | None
    lowering: str | None
    rule: str = "default"
    modelled: SiteTimes | None = None

    op = property(lambda self: self.site.op)
    M = property(lambda self: self.site.M)
    K = property(lambda self: self.site.K)
    N = property(lambda self: self.site.N)
    dtype = property(lambda self: self.site.dtype)
    experts = property(lambda self: self.site.experts)  # E of an expert site: E GEMMs over the M sorted tokens

    @property
    def rewritten(self) -> bool:
        return self.recipe is not None

    @classmethod
    def from_decision(cls, decision: Decision, policy: Policy | None = None,
                      gpu: "str | GPU | None" = None) -> "SiteRecord":
        rule = "default"
        if decision.rule_index is not None and policy is not None:
            rule = policy.rule_label(decision.rule_index)
        recipe = decision.recipe if decision.rewritten else None
        return cls(path=decision.site.path, site=decision.site.info, recipe=recipe, reason=decision.reason,
                   lowering=decision.lowering.value if decision.lowering else None, rule=rule,
                   modelled=_modelled(decision.site.info, recipe or (policy.default if policy else None), gpu))


def _modelled(site: SiteInfo, recipe: Recipe | None, gpu: "str | GPU | None") -> SiteTimes | None:
    """The site's modelled times in ``recipe`` (current scaling's when there is none to compare with)."""
    if gpu is None or not all(isinstance(size, int) for size in (site.M, site.K, site.N)) \
            or 0 in (site.M, site.K, site.N):
        return None
    return site_times(site, recipe if recipe is not None else "current", gpu)


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    return str(value)


class ExplainReport(list):
    """The sites of a model in graph order, one :class:`SiteRecord` each.

    Attributes:
        graph_count: how many graphs Dynamo produced.
        graph_breaks: Dynamo's reason for each graph break.
        graph_code: the Python code of each rewritten FX graph.
        graph_outlines: each rewritten graph's nodes, for drawing (see ``report_html``).
        unmatched_rules: policy rules that matched no site.
        all_gathers: under FSDP2, how each sharded weight is all-gathered (in FP8 or in high precision, and
            why): :class:`fp8graph.fsdp.install.GatherRecord`, empty without FSDP2.
    """

    def __init__(self, records, graph_count: int = 0, unmatched_rules: list[str] | None = None,
                 graph_breaks: list[str] | None = None, graph_code: list[str] | None = None,
                 graph_outlines: list | None = None, all_gathers: list | None = None):
        super().__init__(records)
        self.all_gathers = list(all_gathers or [])
        self.graph_count = graph_count
        self.unmatched_rules = list(unmatched_rules or [])
        self.graph_breaks = list(graph_breaks or [])
        self.graph_code = list(graph_code or [])
        self.graph_outlines = list(graph_outlines or [])

    @property
    def recipe_counts(self) -> dict[str, int]:
        """How many sites run with each recipe, by the recipe's short name."""
        return dict(collections.Counter(str(r.recipe) for r in self.rewritten))

    @property
    def reason_counts(self) -> dict[str, int]:
        """How many sites stay in high precision for each reason."""
        return dict(collections.Counter(r.reason for r in self.kept))

    def to_html(self, path) -> pathlib.Path:
        """Write a self-contained HTML page: the table and each rewritten graph, drawn."""
        from fp8graph.inspection.report_html import render_html

        path = pathlib.Path(path)
        path.write_text(render_html(self), encoding="utf-8")
        return path

    @property
    def rewritten(self) -> list[SiteRecord]:
        return [r for r in self if r.rewritten]

    @property
    def kept(self) -> list[SiteRecord]:
        return [r for r in self if not r.rewritten]

    def table(self) -> Table:
        table = Table(title=f"fp8graph: {len(self.rewritten)} of {len(self)} sites in FP8, "
                            f"{self.graph_count} graph(s)")
        with_experts = any(r.experts is not None for r in self)
        gpus = sorted({r.modelled.gpu for r in self if r.modelled is not None})
        modelled = (f"{', '.join(gpus)} us BF16 / FP8",) if gpus else ()
        columns = ("module path", "op", "M", "K", "N", *(("E",) if with_experts else ()), "input dtype",
                   "FP8 recipe / reason kept", *modelled, "lowering", "decided by")
        for column in columns:
            table.add_column(column, overflow="fold")
        for r in self:
            decision = f"[green]{r.recipe}[/green]" if r.rewritten else f"[yellow]{r.reason}[/yellow]"
            experts = (_cell(r.experts),) if with_experts else ()
            times = ()
            if modelled:
                times = ("-" if r.modelled is None else f"{r.modelled.bf16_us:,.1f} / {r.modelled.fp8_us:,.1f}",)
            table.add_row(r.path or "<root>", r.op, _cell(r.M), _cell(r.K), _cell(r.N), *experts,
                          _cell(r.dtype), decision, *times, _cell(r.lowering), r.rule)
        if self.unmatched_rules:
            table.caption = "policy rules that matched no site: " + ", ".join(self.unmatched_rules)
        return table

    def summary_lines(self) -> list[str]:
        """Counts per recipe and per reason, and the graphs Dynamo produced."""
        lines = [f"{count} site(s) in FP8 with {recipe}" for recipe, count in self.recipe_counts.items()]
        lines += [f"{count} site(s) kept: {reason}" for reason, count in self.reason_counts.items()]
        if self.all_gathers:
            fp8 = [record for record in self.all_gathers if record.fp8]
            lines.append(f"FSDP2 all-gathers {len(fp8)} of {len(self.all_gathers)} sharded weight(s) in FP8")
            if fp8:
                lines.append(f"  {sum(r.fp8_bytes for r in fp8) / 1e6:.3g} MB a gather of them, scales included, "
                             f"against {sum(r.high_precision_bytes for r in fp8) / 1e6:.3g} MB in high precision")
            no_fewer = collections.Counter(r.recipe.name for r in fp8 if r.fp8_bytes >= r.high_precision_bytes)
            lines += [f"  {count} of them ({recipe}) gather no fewer bytes than in high precision: they save the "
                      "graph's casts, not bytes" for recipe, count in no_fewer.items()]
            reasons = collections.Counter(record.reason for record in self.all_gathers if not record.fp8)
            lines += [f"  {count} in high precision: {reason}" for reason, count in reasons.items()]
        lines.append(f"{self.graph_count} graph(s), {len(self.graph_breaks)} graph break(s)")
        lines += [f"  graph break: {reason}" for reason in self.graph_breaks]
        return lines

    def __str__(self) -> str:
        buffer = io.StringIO()
        console = Console(file=buffer, width=180, color_system=None)
        console.print(self.table())
        for line in self.summary_lines():
            console.print(line, highlight=False)
        return buffer.getvalue()

    __repr__ = list.__repr__
