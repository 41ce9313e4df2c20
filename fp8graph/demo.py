"""Train a small Llama on real text in FP8 and in BF16, and compare the losses.

Both runs start from the same seeded weights, see the same batches and keep
fp32 master weights under BF16 autocast; the FP8 run also has every eligible
projection rewritten by the fp8 backend, with FP8 health statistics
recorded every few steps. Prints the rewrite table, the least healthy FP8
tensors and both final losses, and writes the loss curves, the per-site
health plot and CSV, and the HTML view of the rewritten graph. On CPU the GEMMs are emulated and
the graphs lowered with ``aot_eager`` (Inductor's CPU compile would take
minutes); on a CUDA GPU with FP8 support they run on ``_scaled_mm`` through Inductor.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import pathlib
import time

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

import fp8graph
from fp8graph.models import build
from fp8graph.models.text_data import TextBatches

console = Console()
if not console.is_terminal:  # logs and CI: wide enough for the rewrite table
    console.width = 150


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=200, help="training steps per run")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--model", default="demo", help="Llama config from fp8graph.models.llama")
    parser.add_argument("--compiler", choices=("auto", "inductor", "aot_eager"), default="auto",
                        help="auto: inductor on CUDA, aot_eager on CPU")
    parser.add_argument("--stats-every", type=int, default=10, help="record FP8 health every N steps")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("demo_out"))


@dataclasses.dataclass
class RunResult:
    name: str
    losses: list[float]
    eval_loss: float
    seconds: float


def _train(name: str, compiled, model, args, device, progress: Progress, with_stats=None) -> RunResult:
    """Train ``model`` through ``compiled``; every ``--stats-every`` steps through ``with_stats``."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: 0.5 * (1 + math.cos(math.pi * step / args.steps)))
    batches = TextBatches(args.batch_size, args.seq_len, seed=0)
    task = progress.add_task(name, total=args.steps, loss=float("nan"))
    losses = []
    start = time.perf_counter()
    for step in range(args.steps):
        tokens = batches.next().to(device)  # (B, T)
        sample_stats = with_stats is not None and (step % args.stats_every == 0 or step == args.steps - 1)
        with torch.autocast(device.type, dtype=torch.bfloat16):
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
    seconds = time.perf_counter() - start
    eval_batches = TextBatches(args.batch_size, args.seq_len, seed=1, split="eval")
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16):
        eval_loss = sum(compiled(t := eval_batches.next().to(device), labels=t).loss.item()
                        for _ in range(4)) / 4
    return RunResult(name, losses, eval_loss, seconds)


def _plot(results: list[RunResult], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4))
    for result in results:
        axis.plot(result.losses, label=f"{result.name} (final {result.losses[-1]:.3f})", linewidth=1)
    axis.set_xlabel("step")
    axis.set_ylabel("training loss (nats per byte)")
    axis.set_title("Llama on Python reference text: FP8 vs BF16")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def run(args: argparse.Namespace) -> int:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    compiler = args.compiler if args.compiler != "auto" else (
        "inductor" if device.type == "cuda" else "aot_eager")
    console.print(f"[bold]fp8graph demo[/bold]: Llama '{args.model}' on {device}, compiler {compiler}, "
                  f"{args.steps} steps of {args.batch_size}x{args.seq_len} bytes, torch {torch.__version__}")

    fp8_model = build("llama", args.model, seed=0).to(device)
    bf16_model = build("llama", args.model, seed=0).to(device)
    fp8_compiled = fp8graph.compile(fp8_model, compiler=compiler)
    # A second compile of the same model with stats: the steps that sample
    # FP8 health run through it, the others pay nothing for the statistics.
    fp8_with_stats = fp8graph.compile(fp8_model, compiler=compiler, stats=True)
    stats = fp8_with_stats.fp8graph_stats
    bf16_compiled = torch.compile(bf16_model, backend=compiler)

    columns = (TextColumn("{task.description:>5}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("loss {task.fields[loss]:.3f}"), TimeRemainingColumn())
    with Progress(*columns, console=console) as progress:
        results = [_train("FP8", fp8_compiled, fp8_model, args, device, progress, fp8_with_stats),
                   _train("BF16", bf16_compiled, bf16_model, args, device, progress)]

    args.out.mkdir(parents=True, exist_ok=True)
    sample = TextBatches(2, args.seq_len, seed=2).next().to(device)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        report = fp8graph.explain(fp8_compiled, sample)
    console.print(report.table())
    html = report.to_html(args.out / "fp8_report.html")

    worst = sorted(stats.latest(), key=lambda row: row.sqnr_db)[:8]
    console.print(stats.table(worst), "(the 8 tensors with the lowest SQNR at the last step)")
    csv_path = stats.to_csv(args.out / "fp8_stats.csv")
    health_png = stats.plot(args.out / "fp8_health.png")

    for result in results:
        console.print(f"{result.name:>5}: final training loss {result.losses[-1]:.4f}, "
                      f"held-out loss {result.eval_loss:.4f}, {result.seconds:.1f} s")
    fp8, bf16 = results
    console.print(f"FP8 held-out loss is {100 * (fp8.eval_loss / bf16.eval_loss - 1):+.2f}% vs BF16")
    png = args.out / "loss_curve.png"
    _plot(results, png)
    console.print(f"written: {png} (loss curves), {health_png} (per-site FP8 health), "
                  f"{csv_path} (FP8 stats), {html} (rewritten graph)")
    return 0
