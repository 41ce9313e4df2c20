"""A mixture-of-experts block (Qwen3-30B-A3B's): training tokens/s per contestant on a CUDA GPU.

The block is ``fp8graph.models.build("moe", config)`` (models/moe.py: HuggingFace's ``grouped_mm`` experts
path in plain PyTorch: router linear, softmax, top-k, sort, gather, ``torch._grouped_mm`` gate_up, SwiGLU,
``torch._grouped_mm`` down, weigh, scatter and sum), in BF16 with Inductor, on ``batch`` x ``tokens``
tokens. ``--config bench`` (the default) is one Qwen3-30B-A3B MoE block: hidden 2048, 128 experts, top 8,
expert width 768. A training step is

    out = compiled(x); out.backward(grad_output)      x (batch, tokens, hidden) BF16, requiring grad
    p.add_(p.grad, alpha=-1e-5) for every parameter   eager SGD, as bench decoder's

Contestants (each in a process of its own, as bench decoder's): ``bf16`` (plain ``torch.compile``),
fp8graph's ``rowwise``, ``current`` and ``delayed`` (``fp8graph.compile`` with that recipe: the two expert
GEMMs become ``fp8graph_grouped_<recipe>`` targets, ``torch._scaled_grouped_mm`` on SM90; the router stays
BF16; an fp8graph whose expert sites keep a recipe in high precision gives an error row, never a timing),
and ``torchao moe rowwise``: torchao's MoE training (``torchao.prototype.moe_training``,
``Float8TrainingOpConfig``, row-wise FP8) applied with ``quantize_`` to the ``experts`` module only, whose
3-D weights become the tensor subclass that runs ``torch._grouped_mm`` as its own FP8 grouped GEMMs. As
torchtitan runs it, each expert's token group is padded to a multiple of 16 rows before the grouped GEMMs and
unpadded after (``PaddedExperts``: torchao's FP8 grad_weight GEMM needs it, and torchao does not pad), and
the padding is timed with the rest of the step.
Each row: tokens/s from the median step, peak memory, memory saved for backward, first-step (compile)
time, and with ``--profile`` kernel time by category. ``--smoke`` runs the tiny block on CPU with
``aot_eager`` (timings mean nothing; torchao's Triton kernels need CUDA, so its row is an error there).
The device-free model of the same step: ``python -m bench model moe``.

``--decode`` measures a decode step instead: the block with transformers' ``batched_mm`` experts
(``implementation="batched_mm"``: each (token, expert) pair's weight picked by index), in eval mode under
``torch.no_grad()``, on ``batch`` sequences of one token, compiled with Inductor's freezing: ``bf16`` as
plain ``torch.compile`` with freezing on, fp8graph's recipes with ``freeze_weights=True`` (their expert
GEMMs read FP8 constants through ``fp8graph::gathered_gemv``). torchao's MoE training has no decode path:
it is not a contestant there. ``--smoke --decode`` compiles the tiny block with Inductor on CPU (freezing
needs it).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import time

import torch
from torch._inductor import config as inductor_config

from . import forked
from .auto_policy import AUTO, auto_policy
from .cli import contestants_of, positive, require_cuda

__all__ = ["AUTO", "DEFAULT", "UNCACHED", "KNOWN", "SWEEP", "SweepShape", "parse_contestant", "swap_in_torchao",
           "PaddedExperts", "padded_token_groups", "TORCHAO_GROUP_ALIGNMENT", "child_command", "compile_block",
           "freeze_experts", "sgd_step"]

# fp8graph's recipes on expert sites with a native SM90 GEMM (delayed since commit 8d924b3).
RECIPES = ("rowwise", "current", "delayed")
TORCHAO = "torchao moe rowwise"
# Rows every token group (an expert's tokens) of torchao's FP8 grouped GEMMs must be a multiple of. grad_weight
# = grad_output^T @ input contracts over the tokens, and on SM90 an FP8 GEMM reads both operands K-major: the
# tokens contiguous in every row, each group starts its first token's byte into the row, which TMA needs
# 16-byte aligned: a multiple of 16 FP8 tokens, or torch's prepare_grouped_gemm_data fails a device-side
# assert (ATen/native/cuda/GroupMMCommon.cuh). (BF16's grad_weight reads its operands with the tokens the outer
# dimension, where every group starts aligned: the block's BF16 step needs no padding.)
# torchao 0.18 leaves the padding to its users (Float8TrainingOpConfig's pad_token_groups_for_grouped_mm=True
# asserts "not yet supported"); torchtitan pads to set_token_group_alignment_size_m(16) for FP8 row-wise.
TORCHAO_GROUP_ALIGNMENT = 16
# Every fp8graph contestant has buffers for its weights' FP8 casts (cache_weights="auto"), used inside
# fp8graph.weights_unchanged: cast once per declaration, read by the step's other micro-batches (the cost model's
# gradient accumulation); timed here, where every step is one call outside a declaration, every call casts.
# Current scaling with cache_weights=False has no buffers: what they cost.
UNCACHED = "current uncached"
# A recipe on the expert MLP's first GEMM alone (gate_up; the down projection in BF16): the sweep's steps that
# split what a recipe adds to a block between its two expert GEMMs (bench.costmodel.site_casts).
FIRST_GEMM_ONLY = tuple(f"{recipe} gate_up only" for recipe in RECIPES)
KNOWN = ["bf16", *RECIPES, TORCHAO, *AUTO, *(f"{recipe} uncached" for recipe in RECIPES), *FIRST_GEMM_ONLY]
DEFAULT = ["bf16", "rowwise", "current", TORCHAO, "delayed"]
DECODE_DEFAULT = ["bf16", "rowwise", "current", "delayed"]
CONFIGS = ("bench", "tiny", "tiny-odd")  # models/moe.py's


@dataclasses.dataclass(frozen=True)
class SweepShape:
    """One MoE block of the sweep (``bench model moe --sweep``): models/moe.py's ``config`` with ``overrides``,
    on ``batch`` x ``tokens`` tokens."""

    name: str
    overrides: dict
    batch: int
    tokens: int
    config: str = "bench"

    @property
    def tokens_per_expert(self) -> int:
        from fp8graph.models.moe import CONFIGS as model_configs

        fields = {**model_configs[self.config], **self.overrides}
        return self.batch * self.tokens * fields["top_k"] // fields["experts"]

    @property
    def label(self) -> str:
        return f"{self.name}, {self.batch}x{self.tokens}, {self.tokens_per_expert} tokens an expert"


# The shapes people train MoE experts at. Qwen3-30B-A3B's block (the bench config: hidden 2048, 128 experts, top
# 8, expert width 768) at 256, 1024 and 2048 tokens an expert. DeepSeek-V3's experts (hidden 7168, width 2048;
# 256 experts, top 8) as one rank of expert parallelism holds them: 8 experts, and 4096 (token, expert) rows
# routed to each, which the rank receives as 32768 rows of one expert each (top 1 of its 8). Llama-4 Scout's
# (16 experts, top 1, hidden 5120, width 8192) on 1 x 8192 tokens: 512 an expert.
SWEEP = (
    SweepShape("Qwen3-30B-A3B", {}, 1, 4096),
    SweepShape("Qwen3-30B-A3B", {}, 4, 4096),
    SweepShape("Qwen3-30B-A3B", {}, 8, 4096),
    SweepShape("DeepSeek-V3 experts, 8 a rank", dict(hidden=7168, expert_width=2048, experts=8, top_k=1), 8, 4096),
    SweepShape("Llama-4 Scout experts", dict(hidden=5120, expert_width=8192, experts=16, top_k=1), 1, 8192),
)


def parse_contestant(name: str) -> tuple[str, dict[str, bool]]:
    """``("rowwise", {"combo_kernels": True})`` of ``"rowwise +combo_kernels"`` (bench decoder's Inductor
    settings); raises ``ValueError`` on a name this benchmark does not know."""
    from .decoder import parse_contestant as parse

    return parse(name, KNOWN)


def padded_token_groups(expert_ids: torch.Tensor, experts: int, alignment: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The layout torchtitan gives torchao's grouped GEMMs (its ``generate_permute_indices``): the S rows sorted
    by expert (``expert_ids``, ascending, as the block sorts them) with each expert's group padded to a multiple
    of ``alignment`` rows, an expert without tokens to one group of ``alignment`` rows.

    Returns ``(source, group_ends)``: ``source`` (padded rows,) is the sorted row each padded row copies, S for
    a padding row (the zero row appended after the S rows); ``group_ends`` (E,) int32 the padded groups' ends,
    the grouped GEMMs' ``offs``. There are S + E * alignment padded rows rounded up to ``alignment``, a size the
    shapes fix: the counts never leave the device, and the step compiles as one graph. The rows past the last
    group belong to no group: the GEMMs leave them unwritten and unpadding drops them."""
    rows, device = expert_ids.shape[0], expert_ids.device
    counts = torch.histc(expert_ids.float(), bins=experts, min=0, max=experts - 1).long()  # as models/moe.py
    padded_counts = (counts.clamp_min(alignment) + alignment - 1) // alignment * alignment
    group_ends = padded_counts.cumsum(0)
    # Sorted row s of expert e moves from e's first sorted row to e's first padded row.
    shift = (group_ends - padded_counts) - (counts.cumsum(0) - counts)
    destination = torch.arange(rows, device=device) + shift[expert_ids]
    padded_rows = -(-(rows + experts * alignment) // alignment) * alignment
    source = torch.full((padded_rows,), rows, dtype=torch.long, device=device)
    source[destination] = torch.arange(rows, device=device)
    return source, group_ends.to(torch.int32)


class PaddedExperts(torch.nn.Module):
    """models/moe.py's ``grouped_mm`` experts (its parameters, its math) with each expert's token group padded
    to a multiple of ``alignment`` rows around the two grouped GEMMs, as torchtitan runs torchao's MoE training
    (``indices_padding_wrapper``: ``_permute`` before the experts, ``_unpermute`` after): the rows sorted by
    expert are gathered into the padded layout, a zero row standing in for every padding row, and the GEMMs'
    output rows are written back to their sorted places, the padding's onto a row that is then dropped.

    For torchao's contestant only: its FP8 grouped GEMMs need the groups aligned (``TORCHAO_GROUP_ALIGNMENT``)
    and torchao 0.18 leaves the padding to its users; what the gather and scatter cost is part of what they pay,
    and is timed with the step. BF16 and fp8graph run the block's own experts."""

    def __init__(self, experts: torch.nn.Module, alignment: int = TORCHAO_GROUP_ALIGNMENT):
        super().__init__()
        if experts.implementation != "grouped_mm":
            raise ValueError(f"only grouped_mm experts have token groups to pad, not {experts.implementation!r}")
        self.num_experts, self.transposed, self.alignment = experts.num_experts, experts.transposed, alignment
        self.gate_up_proj, self.down_proj = experts.gate_up_proj, experts.down_proj  # the same parameters

    def _grouped(self, x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        weight_kn = weight if self.transposed else weight.transpose(-2, -1)  # (E, K, N), as models/moe.py
        return torch._grouped_mm(x, weight_kn, offs=offsets)

    def forward(self, tokens, top_k_index, top_k_weights):  # (T', H), (T', k), (T', k)
        top_k, hidden = top_k_index.shape[-1], tokens.shape[-1]
        expert_ids, perm = torch.sort(top_k_index.reshape(-1))  # (S,), S = T' k
        input_sorted = tokens[perm // top_k]  # (S, H): the block's gather
        source, group_ends = padded_token_groups(expert_ids, self.num_experts, self.alignment)
        input_padded = torch.cat([input_sorted, input_sorted.new_zeros(1, hidden)])[source]  # torchtitan's _permute
        gate, up = self._grouped(input_padded, self.gate_up_proj, group_ends).chunk(2, dim=-1)
        output_padded = self._grouped(torch.nn.functional.silu(gate) * up, self.down_proj, group_ends)
        # torchtitan's _unpermute: every padded row back to its sorted row; the padding's, and the unwritten
        # rows past the last group, all land on row S, which is dropped.
        output_sorted = output_padded.new_empty(input_sorted.shape[0] + 1, hidden)
        output_sorted[source] = output_padded
        y = output_sorted[:-1] * top_k_weights.reshape(-1)[perm].unsqueeze(-1)
        inverse = torch.empty_like(perm)
        inverse[perm] = torch.arange(perm.shape[0], device=perm.device)
        return y[inverse].view(tokens.shape[0], top_k, -1).sum(dim=1)  # (T', H): the block's scatter


def swap_in_torchao(block: torch.nn.Module) -> int:
    """torchao's row-wise FP8 MoE training as torchtitan runs it: ``block.experts`` becomes ``PaddedExperts``
    (token groups padded to ``TORCHAO_GROUP_ALIGNMENT`` rows), and its parameters, only they, each become a
    ``Float8TrainingWeightWrapperTensor``, whose ``__torch_function__`` runs ``torch._grouped_mm(x, w, offs)``
    as torchao's ``_Float8GroupedMM`` (its Triton casts, ``torch._scaled_grouped_mm`` forward, grad_input and
    grad_weight). The router (``block.gate``) is untouched. Returns how many parameters were wrapped."""
    from torchao.prototype.moe_training.config import Float8TrainingOpConfig
    from torchao.prototype.moe_training.tensor import Float8TrainingWeightWrapperTensor
    from torchao.quantization import quantize_

    block.experts = PaddedExperts(block.experts)
    quantize_(block, Float8TrainingOpConfig(), filter_fn=lambda module, fqn: fqn == "experts")
    wrapped = sum(isinstance(p, Float8TrainingWeightWrapperTensor) for p in block.experts.parameters())
    if wrapped != len(list(block.experts.parameters())):
        raise RuntimeError(f"torchao wrapped {wrapped} of the experts' parameters")
    return wrapped


def freeze_experts(block: torch.nn.Module) -> None:
    """``--frozen-experts``: the experts' weights take no gradient (fine-tuning the rest of a model, the router and
    the attention around it), so the step runs no grad_weight GEMM; grad_input still flows through the experts."""
    block.experts.requires_grad_(False)


def compile_block(block: torch.nn.Module, contestant: str, compiler, policy_gpu: str | None = None):
    """``block`` compiled as ``contestant`` (a base name): plain ``torch.compile`` for BF16 and torchao (whose
    conversion is done beforehand), ``fp8graph.compile`` with ``policies.auto()`` of the named recipe (current
    by default) for ``auto``, its sites timed on ``policy_gpu`` (``None``: the GPU this runs on), a recipe with
    ``cache_weights=False`` for ``<recipe> uncached``, a recipe on the first expert GEMM alone for ``<recipe>
    gate_up only``, with the recipe's preset as the policy otherwise."""
    if contestant == "bf16" or contestant.startswith("torchao"):
        return torch.compile(block, backend=compiler)
    import fp8graph
    from fp8graph.recipes import PRESETS

    if contestant in AUTO:
        return fp8graph.compile(block, policy=auto_policy(contestant, policy_gpu), compiler=compiler)
    if contestant.endswith(" uncached"):
        recipe = contestant.removesuffix(" uncached")
        return fp8graph.compile(block, policy=PRESETS[recipe], compiler=compiler, cache_weights=False)
    if contestant in FIRST_GEMM_ONLY:
        recipe = PRESETS[contestant.removesuffix(" gate_up only")]
        return fp8graph.compile(block, policy=fp8graph.Policy(default=None, rules=[(first_expert_gemm, recipe)]),
                                compiler=compiler)
    return fp8graph.compile(block, policy=PRESETS[contestant], compiler=compiler)


def first_expert_gemm(path, module, site) -> bool:
    """A policy predicate: the expert MLP's first GEMM (its output read by SwiGLU alone)."""
    return site.expert_stage == 0


def fp8_note(compiled, block) -> str:
    """What the contestant put in FP8: torchao's wrapped expert weights, or fp8graph's decisions."""
    wrapped = [name for name, p in block.named_parameters() if "TrainingWeightWrapper" in type(p).__name__]
    if wrapped:
        padding = (f"; token groups padded to multiples of {block.experts.alignment} rows, as torchtitan pads them"
                   if isinstance(block.experts, PaddedExperts) else "")
        return f"torchao: {', '.join(wrapped)} wrapped (row-wise FP8 grouped GEMMs){padding}; the router in BF16"
    backend = getattr(compiled, "fp8graph_backend", None)
    if backend is None:
        return ""
    decisions = backend.decisions
    kept = sorted({f"{d.site.path or '<root>'} ({d.site.op}): {d.reason.split(':')[0]}"
                   for d in decisions if not d.rewritten})
    return f"fp8graph: {sum(d.rewritten for d in decisions)} of {len(decisions)} sites in FP8" + \
        (f"; kept: {'; '.join(kept[:4])}" if kept else "")


# --- the GPU measurement -----------------------------------------------------------------------------------

def _settings(args) -> dict:
    if args.smoke:  # decode compiles with Inductor, which freezing needs
        return {"device": torch.device("cpu"), "compiler": "inductor" if args.decode else "aot_eager",
                "config": "tiny", "batch": 2, "tokens": 1 if args.decode else 16, "warmup": 1, "repeats": 2}
    return {"device": torch.device("cuda"), "compiler": "inductor", "config": args.config, "batch": args.batch,
            "tokens": 1 if args.decode else args.tokens, "warmup": 3, "repeats": args.repeats}


def measure_decode(name: str, args) -> dict:
    """One contestant's decode row (see the module's doc), measured in this process."""
    import fp8graph
    from fp8graph.models import build
    from fp8graph.recipes import PRESETS

    from .timing import median, require_fp8_sites, time_compiled

    contestant, patches = parse_contestant(name)
    if contestant.startswith("torchao"):
        raise RuntimeError("torchao's MoE training (moe_training) has no decode path")
    settings = _settings(args)
    device = settings["device"]
    torch._dynamo.reset()
    block = build("moe", settings["config"], device=device, dtype=torch.bfloat16, implementation="batched_mm").eval()
    generator = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(settings["batch"], 1, block.gate.in_features, device=device, dtype=torch.bfloat16,
                    generator=generator)
    with inductor_config.patch({**patches, "freezing": True}), torch.no_grad():
        compiled = (torch.compile(block) if contestant == "bf16"
                    else fp8graph.compile(block, policy=PRESETS[contestant], freeze_weights=True))
        torch._dynamo.utils.counters.clear()
        started = time.perf_counter()
        compiled(x)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        row = {"contestant": name, "inductor_settings": patches, "compile_s": time.perf_counter() - started,
               "note": fp8_note(compiled, block)}
        require_fp8_sites(compiled)
        row["decode_timings_ms"] = time_compiled(lambda: compiled(x), device, settings["warmup"], settings["repeats"])
    row["decode_tokens_per_s"] = settings["batch"] / (median(row["decode_timings_ms"]) / 1e3)
    return row


def measure_contestant(name: str, args) -> dict:
    """One contestant's row, measured in this process, under its Inductor settings if its name has any."""
    from fp8graph.models import build

    from .memory import saved_for_backward_bytes
    from .profile import profile_steps
    from .timing import accumulated_step, last_weight_cast_mode, median, require_fp8_sites, time_compiled

    contestant, patches = parse_contestant(name)
    settings = _settings(args)
    device = settings["device"]
    torch._dynamo.reset()
    block = build("moe", settings["config"], device=device, dtype=torch.bfloat16)
    if contestant.startswith("torchao"):
        if device.type != "cuda":
            raise RuntimeError("torchao's MoE training casts with Triton kernels, which need CUDA")
        swap_in_torchao(block)
    if args.frozen_experts:
        freeze_experts(block)
    hidden = block.gate.in_features
    generator = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(settings["batch"], settings["tokens"], hidden, device=device, dtype=torch.bfloat16,
                    generator=generator, requires_grad=True)
    grad_output = torch.randn(x.shape, device=device, dtype=torch.bfloat16, generator=generator)
    with inductor_config.patch(patches):
        compiled = compile_block(block, contestant, settings["compiler"])

        def sgd():
            sgd_step(block)
            x.grad = None

        step = accumulated_step(compiled, lambda: compiled(x).backward(grad_output), sgd, args.grad_accumulation)

        torch._dynamo.utils.counters.clear()
        started = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        row = {"contestant": name, "inductor_settings": patches, "compile_s": time.perf_counter() - started,
               "note": fp8_note(compiled, block)}
        require_fp8_sites(compiled)  # an fp8graph contestant with every site kept is not timed as FP8
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        row["train_timings_ms"] = time_compiled(step, device, settings["warmup"], settings["repeats"])
        row["last_micro_batch_weight_casts"] = last_weight_cast_mode(compiled)
        row["train_tokens_per_s"] = (args.grad_accumulation * x.shape[0] * x.shape[1]
                                     / (median(row["train_timings_ms"]) / 1e3))
        row["peak_memory_gb"] = torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None
        if args.profile:
            row["profile"] = profile_steps(step, device)
        row["saved_gb"] = saved_for_backward_bytes(lambda: _as_loss(compiled(x), grad_output),
                                                   block.parameters()) / 1e9
    for parameter in block.parameters():
        parameter.grad = None
    return row


def sgd_step(block: torch.nn.Module, lr: float = 1e-5) -> None:
    """The step's eager SGD, as bench decoder's: ``p.add_(p.grad, alpha=-lr)`` for each parameter with a gradient
    (frozen experts have none), then the gradients dropped."""
    with torch.no_grad():
        for parameter in block.parameters():
            if parameter.grad is not None:
                parameter.add_(parameter.grad, alpha=-lr)
                parameter.grad = None


def _as_loss(out: torch.Tensor, grad_output: torch.Tensor) -> torch.Tensor:
    """A scalar whose gradient on ``out`` is ``grad_output`` (bench.memory runs ``.backward()`` on it)."""
    return (out * grad_output).sum()


def child_command(name: str, args) -> list[str]:
    """``bench``'s arguments for a child process that measures contestant ``name`` as ``args`` ask."""
    command = ["moe", "--one", name, "--config", args.config, "--tokens", str(args.tokens), "--batch",
               str(args.batch), "--repeats", str(args.repeats), "--grad-accumulation", str(args.grad_accumulation)]
    return command + [flag for flag, wanted in (("--smoke", args.smoke), ("--profile", args.profile),
                                                ("--decode", args.decode), ("--frozen-experts", args.frozen_experts))
                      if wanted]


def _in_own_process(name: str, args) -> dict:
    """``measure_contestant`` in a child process (its own CUDA context and peak memory); a crash or timeout
    is the row's error, and the other contestants go on."""
    return forked.row_in_child(name, child_command(name, args), args.contestant_timeout)


def wanted_contestants(requested: list[str] | None, decode: bool = False) -> list[str]:
    """bf16 first (every ratio needs it), then the others; an unknown name exits before anything runs."""
    return contestants_of(requested, DECODE_DEFAULT if decode else DEFAULT, parse_contestant)


def run(args: argparse.Namespace) -> dict:
    from .timing import attempt, environment, report, write_partial

    if args.one:  # a child process of a run: one contestant's row into --row-file
        measure = measure_decode if args.decode else measure_contestant
        row = attempt({"contestant": args.one}, lambda: measure(args.one, args))
        args.row_file.write_text(json.dumps(row))
        return row
    wanted = wanted_contestants(args.contestants, args.decode)
    require_cuda("moe", args)
    settings = _settings(args)
    rows: list[dict] = []
    result = {"workload": "moe_decode" if args.decode else "moe_block", "smoke": args.smoke,
              "compiler": settings["compiler"], "config": settings["config"], "batch": settings["batch"],
              "sequence": settings["tokens"], "environment": environment(settings["device"]),
              "warmup": settings["warmup"],
              "repeats": settings["repeats"], "process_per_contestant": True,
              "grad_accumulation": args.grad_accumulation, "frozen_experts": args.frozen_experts, "rows": rows}
    for name in wanted:
        rows.append(_in_own_process(name, args))
        print(f"{name}: {'error' if 'error' in rows[-1] else 'measured'}", flush=True)
        write_partial(result, args.out, "moe")
    add_ratios(rows)
    return report(result, args.out, "moe-decode" if args.decode else "moe", summary)


def add_ratios(rows: list[dict]) -> None:
    """Each row's tokens/s over BF16's and over torchao's (above 1: this row is faster)."""
    measured = {row["contestant"]: row for row in rows if "error" not in row}
    for row in measured.values():
        for baseline, key in (("bf16", "train_speedup_vs_bf16_compile"), (TORCHAO, "train_speedup_vs_torchao")):
            if baseline in measured and "train_tokens_per_s" in row:
                row[key] = row["train_tokens_per_s"] / measured[baseline]["train_tokens_per_s"]
        if "bf16" in measured and "decode_tokens_per_s" in row:
            row["decode_speedup_vs_bf16_compile"] = (row["decode_tokens_per_s"]
                                                     / measured["bf16"]["decode_tokens_per_s"])


def summary(result: dict) -> str:
    from .decoder import _profile_tables
    from .timing import failed, markdown_table, title

    def number(row, key, form):
        return form.format(row[key]) if row.get(key) is not None else "-"

    if result["workload"] == "moe_decode":
        rows = [[r["contestant"], f"{r['decode_tokens_per_s']:.0f}",
                 number(r, "decode_speedup_vs_bf16_compile", "{:.2f}x"), number(r, "compile_s", "{:.1f}")]
                for r in result["rows"] if "error" not in r]
        heading = (f"MoE decode step ({result['config']}, batched_mm experts, frozen weights, "
                   f"batch {result['batch']})")
        return "\n".join([title(heading, result), "", *markdown_table(
            ["contestant", "decode tokens/s", "vs bf16", "first call (compile) s"], rows), *failed(result["rows"])])

    rows = [[r["contestant"], f"{r['train_tokens_per_s']:.0f}", number(r, "train_speedup_vs_bf16_compile", "{:.2f}x"),
             number(r, "train_speedup_vs_torchao", "{:.2f}x"), number(r, "peak_memory_gb", "{:.1f}"),
             number(r, "saved_gb", "{:.3g}"), number(r, "compile_s", "{:.1f}")]
            for r in result["rows"] if "error" not in r]
    columns = ["contestant", "train tokens/s", "vs bf16", "vs torchao moe rowwise", "peak GB",
               "saved for backward GB", "first step (compile) s"]
    micro_batches = result.get("grad_accumulation", 1)
    heading = (f"MoE block ({result['config']}, batch {result['batch']}, {result['sequence']} tokens, "
               + (f"{micro_batches} micro-batches of " if micro_batches > 1 else "")
               + "forward + backward, then SGD"
               + (", the experts' weights frozen)" if result.get("frozen_experts") else ")"))
    notes = [f"- {r['contestant']}: {r['note']}" for r in result["rows"] if r.get("note")]
    return "\n".join([title(heading, result), "", *markdown_table(columns, rows), *([""] + notes if notes else []),
                      *failed(result["rows"]), *_profile_tables(result["rows"])])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--smoke", action="store_true", help="the tiny block on CPU with aot_eager, for the tests")
    parser.add_argument("--decode", action="store_true",
                        help="a decode step (batched_mm experts, frozen weights, one token a sequence) instead of "
                             "a training step")
    parser.add_argument("--config", choices=CONFIGS, default="bench",
                        help="models/moe.py's config: bench is Qwen3-30B-A3B's MoE block")
    parser.add_argument("--tokens", type=positive(int), default=4096, help="tokens per sequence")
    parser.add_argument("--batch", type=positive(int), default=1)
    parser.add_argument("--contestants", nargs="+", metavar="NAME",
                        help=f"run these (and the BF16 baseline) only; known: {KNOWN}; a name may end in "
                             "'+setting' / '-setting' (bench decoder's Inductor settings); default: "
                             f"{DEFAULT}")
    parser.add_argument("--repeats", type=positive(int), default=20)
    parser.add_argument("--grad-accumulation", type=positive(int), default=1, metavar="N",
                        help="micro-batches a training step (fp8graph's declared unchanged: fp8graph.weights_unchanged)")
    parser.add_argument("--frozen-experts", action="store_true",
                        help="the experts' weights frozen: no grad_weight GEMMs (fine-tuning the router and the rest)")
    parser.add_argument("--profile", action="store_true", help="also profile training steps: kernel time by category")
    parser.add_argument("--contestant-timeout", type=positive(float), default=600,
                        help="seconds one contestant may take")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("bench/results"))
    parser.add_argument("--one", metavar="NAME", help=argparse.SUPPRESS)  # a child process's contestant
    parser.add_argument("--row-file", type=pathlib.Path, help=argparse.SUPPRESS)
