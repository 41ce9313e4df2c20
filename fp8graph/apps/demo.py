"""Train a small Llama on real text in FP8 and in high precision, and compare the losses.

Both runs start from the same seeded weights, see the same batches and keep
fp32 master weights; the FP8 run also has every eligible projection
rewritten by the fp8 backend, with FP8 health statistics recorded every few
steps. The high precision is BF16 autocast on a GPU and on a CPU with BF16
matrix units (AMX), fp32 on a CPU without them (see ``fp8graph.apps.demo_baseline``).
Prints the rewrite table, the least healthy FP8 tensors, both final losses
and the wall time of each phase, and writes the loss curves with their gap,
the per-site health plot and CSV, the HTML view of the rewritten graph, and
the trained FP8 model as a checkpoint transformers and vLLM load (``fp8_checkpoint/``).
On CPU the GEMMs are emulated and the graphs lowered with ``aot_eager``
(Inductor's CPU compile would take minutes); on a CUDA GPU with FP8 support
they run on ``_scaled_mm`` through Inductor.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import pathlib
import tempfile
import time

import torch
from rich.console import Console
from rich.table import Table
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

import fp8graph
from fp8graph.apps.demo_baseline import Baseline, choose_baseline
from fp8graph.costs import GPUS, running_gpu
from fp8graph.inspection.loss_plot import save_loss_figure
from fp8graph.models import build
from fp8graph.models.text_data import TextBatches

console = Console()
if not console.is_terminal:  # logs and CI: wide enough for the rewrite table
    console.width = 150


def _at_least(minimum: int, why: str = ""):
    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}{why}, not {value}")
        return value

    return parse


_positive_int = _at_least(1)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=_positive_int, default=200, help="training steps per run")
    parser.add_argument("--batch-size", type=_positive_int, default=16)
    parser.add_argument("--seq-len", type=_at_least(2, " (each byte is trained to predict the next)"), default=128)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--model", default="demo", help="Llama config from fp8graph.models.llama")
    parser.add_argument("--compiler", choices=("auto", "inductor", "aot_eager"), default="auto",
                        help="auto: inductor on CUDA, aot_eager on CPU")
    parser.add_argument("--precision", choices=("auto", "bf16", "fp32"), default="auto",
                        help="high precision of both runs; auto: BF16 autocast on CUDA, and on a CPU "
                             "unless its BF16 matmuls run over 2x slower than fp32 (emulated)")
    parser.add_argument("--policy", choices=("fp8", "auto"), default="fp8",
                        help="fp8: every eligible site in FP8 (current scaling); auto: only the sites the cost "
                             "model says gain on --gpu (fp8graph.policies.auto)")
    parser.add_argument("--gpu", choices=sorted(GPUS), default=None,
                        help="the GPU --policy auto models (default: this CUDA device if it is one of them, "
                             "else H100)")
    parser.add_argument("--stats-every", type=_positive_int, default=10, help="record FP8 health every N steps")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("demo_out"))


@dataclasses.dataclass
class RunResult:
    name: str
    losses: list[float]
    eval_loss: float
    first_steps_seconds: float   # until every compiled variant has run once: the compiles
    first_steps: int
    steps_seconds: float         # the other training steps
    eval_seconds: float


class PhaseTimes:
    """Wall seconds per named phase, in the order the phases ran."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def phase(self, name: str):
        start = time.perf_counter()
        yield
        self.add(name, time.perf_counter() - start)

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    def table(self) -> Table:
        table = Table(title="wall time per phase")
        table.add_column("phase")
        table.add_column("seconds", justify="right")
        for name, seconds in self.seconds.items():
            table.add_row(name, f"{seconds:.1f}")
        table.add_row("[bold]sum of the phases[/bold]", f"[bold]{sum(self.seconds.values()):.1f}[/bold]")
        return table


def _train(name: str, compiled, model, args, device, baseline: Baseline, progress: Progress,
           with_stats=None) -> RunResult:
    """Train ``model`` through ``compiled``; every ``--stats-every`` steps through ``with_stats``."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: 0.5 * (1 + math.cos(math.pi * step / args.steps)))
    batches = TextBatches(args.batch_size, args.seq_len, seed=0)
    task = progress.add_task(name, total=args.steps, loss=float("nan"))

    def samples_stats(step: int) -> bool:
        return with_stats is not None and (step % args.stats_every == 0 or step == args.steps - 1)

    # The first call of each compiled variant compiles it: the steps up to the first that ran
    # through ``compiled`` (and, with stats, through ``with_stats``) are the compile phase.
    first_plain = next((step for step in range(args.steps) if not samples_stats(step)), args.steps - 1)
    first_steps = first_plain + 1
    losses = []
    start = time.perf_counter()
    for step in range(args.steps):
        tokens = batches.next().to(device)  # (B, T)
        sample_stats = samples_stats(step)
        with baseline.autocast(device):
            loss = (with_stats if sample_stats else compiled)(tokens, labels=tokens).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        schedule.step()
        if sample_stats:
            with_stats.fp8graph_stats.record(step)
        losses.append(loss.item())
        progress.update(task, advance=1, loss=losses[-1])
        if step == first_steps - 1:  # first_steps <= args.steps: always reached
            first_steps_done = time.perf_counter()
    end = time.perf_counter()
    eval_batches = TextBatches(args.batch_size, args.seq_len, seed=1, split="eval")
    with torch.no_grad(), baseline.autocast(device):
        eval_loss = sum(compiled(t := eval_batches.next().to(device), labels=t).loss.item()
                        for _ in range(4)) / 4
    return RunResult(name, losses, eval_loss, first_steps_done - start, first_steps,
                     end - first_steps_done, time.perf_counter() - end)


def _steps(count: int) -> str:
    return f"{count} step" if count == 1 else f"{count} steps"


def _check_writable(out: pathlib.Path) -> None:
    """Refuse an --out the results cannot be written to before training, not after both runs."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as error:
        raise SystemExit(f"fp8graph demo: cannot write the results to --out {out}: {error.strerror or error}")


def policy_gpu(args: argparse.Namespace, device: torch.device) -> str:
    """The GPU the cost model times sites on: --gpu, else the CUDA device the demo trains on
    (fp8graph.costs.running_gpu), the H100 for a run on the CPU."""
    if args.gpu is not None:
        return args.gpu
    return running_gpu(device).name if device.type == "cuda" else "H100"


def _policy(args: argparse.Namespace, gpu: str, device: torch.device, model: torch.nn.Module):
    """The FP8 run's policy (``gpu``: what --policy auto models); --policy auto is refused where it would keep
    every site (nothing to show)."""
    if args.policy == "fp8":
        return None  # fp8graph's default: every eligible site in current scaling
    policy = fp8graph.policies.auto(gpu=gpu)
    sample = torch.zeros(args.batch_size, args.seq_len, dtype=torch.long, device=device)
    report = fp8graph.explain(model, sample, policy=policy, regions=None, gpu=gpu)
    if not report.rewritten:
        largest = max((r for r in report if r.modelled is not None), key=lambda r: r.modelled.bf16_us)
        raise SystemExit(
            f"fp8graph demo --policy auto: the cost model keeps all {len(report)} sites of Llama '{args.model}' in "
            f"high precision on {gpu} at {args.batch_size}x{args.seq_len} tokens (the largest, "
            f"{largest.path}: {largest.modelled.describe()}), so the FP8 run would train nothing in FP8. Give a "
            "larger --model, --batch-size or --seq-len, or --policy fp8")
    return policy


def run(args: argparse.Namespace) -> int:
    _check_writable(args.out)
    phases = PhaseTimes()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    compiler = args.compiler if args.compiler != "auto" else (
        "inductor" if device.type == "cuda" else "aot_eager")

    with phases.phase("build the models"):
        fp8_model = build("llama", args.model, seed=0).to(device)
        reference_model = build("llama", args.model, seed=0).to(device)
    baseline = choose_baseline(device, args.precision)
    console.print(f"[bold]fp8graph demo[/bold]: Llama '{args.model}' on {device}, compiler {compiler}, "
                  f"{args.steps} steps of {args.batch_size}x{args.seq_len} bytes, torch {torch.__version__}")
    console.print(f"high precision: {baseline.name} ({baseline.reason})")

    gpu = policy_gpu(args, device)
    policy = _policy(args, gpu, device, fp8_model)
    fp8_compiled = fp8graph.compile(fp8_model, policy=policy, compiler=compiler)
    # A second compile of the same model with stats: the steps that sample
    # FP8 health run through it, the others pay nothing for the statistics.
    fp8_with_stats = fp8graph.compile(fp8_model, policy=policy, compiler=compiler, stats=True)
    stats = fp8_with_stats.fp8graph_stats
    reference_compiled = torch.compile(reference_model, backend=compiler)

    columns = (TextColumn("{task.description:>5}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("loss {task.fields[loss]:.3f}"), TimeRemainingColumn())
    with Progress(*columns, console=console) as progress:
        fp8 = _train("FP8", fp8_compiled, fp8_model, args, device, baseline, progress, fp8_with_stats)
        reference = _train(baseline.name, reference_compiled, reference_model, args, device, baseline,
                           progress)
    for result in (fp8, reference):
        phases.add(f"{result.name}: compile, first {_steps(result.first_steps)}", result.first_steps_seconds)
        phases.add(f"{result.name}: other {_steps(args.steps - result.first_steps)}", result.steps_seconds)
        phases.add(f"{result.name}: held-out loss (compiles a no-grad graph)", result.eval_seconds)

    args.out.mkdir(parents=True, exist_ok=True)
    with phases.phase("explain and the HTML report"):
        sample = TextBatches(2, args.seq_len, seed=2).next().to(device)
        with baseline.autocast(device):
            # Training compiled each decoder layer once (regions). The report traces the whole
            # model as one graph instead, with the same policy and so the same decisions, so
            # the page draws every layer as its own collapsible section, in model order.
            report = fp8graph.explain(fp8_model, sample, policy=policy, regions=None, gpu=gpu)
        html = report.to_html(args.out / "fp8_report.html")
    console.print(report.table())

    with phases.phase("health table, CSV and plots"):
        # NaN first: a broken cast is the least healthy of all (as in the health figure).
        worst = sorted(stats.latest(), key=lambda row: (not math.isnan(row.sqnr_db), row.sqnr_db))[:8]
        csv_path = stats.to_csv(args.out / "fp8_stats.csv")
        health_png = stats.plot(args.out / "fp8_health.png")
        png = save_loss_figure(fp8.losses, reference.losses, reference.name, args.out / "loss_curve.png")
    console.print(stats.table(worst), "(the 8 tensors with the lowest SQNR at the last step)")

    with phases.phase("the FP8 checkpoint"):
        # The FP8 weights the model trained with, in the format their recipe is served in.
        checkpoint = fp8graph.save_fp8(fp8_compiled, str(args.out / "fp8_checkpoint"))
    console.print(str(checkpoint), markup=False, highlight=False)
    console.print(f"load it with: transformers.AutoModelForCausalLM.from_pretrained({checkpoint.directory!r})",
                  markup=False, highlight=False, soft_wrap=True)  # one line, to copy

    for result in (fp8, reference):
        training = result.first_steps_seconds + result.steps_seconds
        console.print(f"{result.name:>5}: final training loss {result.losses[-1]:.4f}, "
                      f"held-out loss {result.eval_loss:.4f}, {training:.1f} s")
    console.print(f"FP8 held-out loss is {100 * (fp8.eval_loss / reference.eval_loss - 1):+.2f}% "
                  f"vs {reference.name}")
    console.print(phases.table())
    console.print(f"written: {png} (loss curves and their gap), {health_png} (per-site FP8 health), "
                  f"{csv_path} (FP8 stats), {html} (the model's rewritten graph, one section per layer)")
    return 0
