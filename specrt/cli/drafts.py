"""Commands for draft heads: train-draft, make-data, build-draft, import-mtp."""

from __future__ import annotations

from pathlib import Path

import click

from specrt.cli.common import (
    HEAD_TENSORRT,
    FiniteFloat,
    _friendly_errors,
    main,
    quantize_option,
    tensorrt_option,
)
from specrt.training.families import PRECISIONS, TRAINED_FAMILIES, TrainOptions, resolve_precision


def _data_options(f):
    """The options that make a training corpus (train-draft and make-data alike)."""
    for option in reversed(_DATA_OPTIONS):
        f = option(f)
    return f


_DATA_OPTIONS = [
    click.option(
        "--artifacts",
        type=click.Path(path_type=Path),
        default=None,
        help="The target's build-engines directory: its ORT engine makes the training data (faster than PyTorch).",
    ),
    quantize_option(
        "--artifacts: the ORT engine of this scheme makes the data, and the head is trained against its features "
        "(it drafts for that engine; e.g. gguf-a8 for a model whose weights stay in its GGUF).",
    ),
    click.option("--prompts", default=2000, show_default=True, type=click.IntRange(min=2), help="Prompts to answer."),
    click.option("--max-new-tokens", default=192, show_default=True, type=click.IntRange(min=1), help="Per answer."),
    click.option("--gen-batch", default=16, show_default=True, type=click.IntRange(min=1), help="Answers per batch."),
    click.option(
        "--hold-out",
        type=click.Path(path_type=Path),
        default=Path("bench/prompts.jsonl"),
        show_default=True,
        help="Benchmark prompts never trained on (skipped when the file is absent).",
    ),
]


def _corpus(checkpoint, artifacts, quantize, prompts, seed, max_new_tokens, gen_batch, hold_out: Path) -> dict:
    """The options that make a corpus, as DataSpec's (and TrainDraftSpec's) fields."""
    from specrt.training.prompts import benchmark_prompts

    held = benchmark_prompts(hold_out) if hold_out.is_file() else ()
    return dict(
        checkpoint=checkpoint,
        artifacts=artifacts,
        quantize=quantize,
        prompts=prompts,
        seed=seed,
        max_new_tokens=max_new_tokens,
        gen_batch=gen_batch,
        hold_out=held,
    )


@main.command("train-draft")
@click.option(
    "--method",
    required=True,
    type=click.Choice(list(TRAINED_FAMILIES)),
    help="The draft to train: " + "; ".join(f"{n}: {f.about}" for n, f in TRAINED_FAMILIES.items()) + ".",
)
@click.option("--model", "checkpoint", required=True, type=click.Path(path_type=Path), help="The target's checkpoint.")
@click.option("--out", required=True, type=click.Path(path_type=Path), help="The head's directory (--draft-dir).")
@click.option(
    "--data",
    type=click.Path(path_type=Path),
    default=None,
    help="Training data directory, shared by the heads of one target (default: OUT/data).",
)
@_data_options
@click.option("--epochs", default=2.0, show_default=True, type=FiniteFloat(0.0, lo_open=True))
@click.option("--lr", default=1e-3, show_default=True, type=FiniteFloat(0.0, lo_open=True))
@click.option(
    "--ttt-steps",
    default=None,
    type=click.IntRange(min=1),
    help="Unrolled draft steps (eagle 1, mtp 2, eagle3 3); peagle: tokens per call (5).",
)
@click.option(
    "--draft-vocab",
    default=None,
    type=click.IntRange(min=1),
    help="eagle3, peagle, medusa, draft-model: the most frequent answer tokens drafted (default 8192).",
)
@click.option("--medusa-heads", default=None, type=click.IntRange(min=1), help="medusa: heads (K; default 4).")
@click.option(
    "--batch-tokens",
    default=None,
    type=click.IntRange(min=64),
    help="eagle, eagle3, peagle, mtp, draft-model: padded tokens per batch (default 4096).",
)
@click.option("--seed", default=0, show_default=True, type=click.IntRange(min=0))
@click.option(
    "--max-minutes", default=None, type=FiniteFloat(0.0, lo_open=True), help="Stop training (checkpointed) after this."
)
@click.option(
    "--precision",
    default="auto",
    show_default=True,
    type=click.Choice(PRECISIONS),
    help="bfloat16: the loss is computed under autocast, the weights stay float32 (2x on a CPU with AVX-512 BF16 "
    "or AMX, the losses the same to 3-4 digits; slower on others); auto: bfloat16 where the CPU has it.",
)
@tensorrt_option(HEAD_TENSORRT)
@_friendly_errors
def train_draft(
    method,
    checkpoint,
    out,
    artifacts,
    quantize,
    data,
    prompts,
    max_new_tokens,
    gen_batch,
    hold_out,
    epochs,
    lr,
    ttt_steps,
    draft_vocab,
    medusa_heads,
    batch_tokens,
    seed,
    max_minutes,
    precision,
    tensorrt,
):
    """Train a draft (an EAGLE-1, EAGLE-3, parallel EAGLE-3 or MTP head, Medusa heads, a distilled draft model) on
    the target's own answers (self-distillation), then export it to ONNX and build its engine.
    Every step resumes where an interrupted run stopped."""
    from specrt.training.pipeline import TrainDraftSpec, train_draft

    options = TrainOptions(
        epochs, lr, seed, max_minutes, batch_tokens, draft_vocab, ttt_steps, medusa_heads, resolve_precision(precision)
    )
    unused = options.unused(method)
    if unused:
        flag = {n: "--medusa-heads" if n == "heads" else "--" + n.replace("_", "-") for n in unused}
        users = {n: ", ".join(m for m, f in TRAINED_FAMILIES.items() if n in f.reads) for n in unused}
        where = "; ".join(f"{flag[n]} is for {users[n]}" for n in unused)
        names = ", ".join(flag.values())
        raise click.UsageError(f"{names}: --method {method} does not read it ({where}); leave it out")
    cfg = TRAINED_FAMILIES[method].config(method, options)
    corpus = _corpus(checkpoint, artifacts, quantize, prompts, seed, max_new_tokens, gen_batch, hold_out)
    spec = TrainDraftSpec(method=method, out=out, data=data, train=cfg, tensorrt=tensorrt, **corpus)
    report = train_draft(spec)
    h = report["held_out"]
    click.echo(
        f"{method} head in {out}: {report['steps']} steps ({report['stopped']}), {report['train_sequences']} "
        f"sequences; held-out acceptance per draft step {h['acceptance']}, expected accepted length "
        f"{h['mean_accepted']:.2f} (chain, bonus included)"
    )


@main.command("make-data")
@click.option("--model", "checkpoint", required=True, type=click.Path(path_type=Path), help="The target's checkpoint.")
@click.option(
    "--data",
    required=True,
    type=click.Path(path_type=Path),
    help="The training data directory (train-draft --data): made, or extended where it holds part of the answers.",
)
@_data_options
@click.option("--seed", default=0, show_default=True, type=click.IntRange(min=0), help="The prompt set's seed.")
@_friendly_errors
def make_data(checkpoint, data, artifacts, quantize, prompts, max_new_tokens, gen_batch, hold_out, seed):
    """Make a draft-training corpus without training: the target's answers to the prompt set (token ids, with
    their features and a line in runs.jsonl for each run), for train-draft --data to train heads on later.
    Interrupted (Ctrl-C)? Run it again: the answers made are kept, and more --prompts extend it."""
    from specrt.training.pipeline import DataSpec, make_data

    corpus = _corpus(checkpoint, artifacts, quantize, prompts, seed, max_new_tokens, gen_batch, hold_out)
    spec = DataSpec(data=data, **corpus)
    made = make_data(spec)
    click.echo(
        f"{made['data']}: {made['answers']} answers, {made['answer_tokens']} answer tokens "
        f"({made['prompt_tokens']} prompt tokens); how each run made them: {made['data']}/runs.jsonl"
    )


@main.command("build-draft")
@click.option("--draft-dir", required=True, type=click.Path(path_type=Path), help="A train-draft output directory.")
@click.option("--model", "checkpoint", required=True, type=click.Path(path_type=Path), help="The target's checkpoint.")
@tensorrt_option(HEAD_TENSORRT)
@_friendly_errors
def build_draft(draft_dir, checkpoint, tensorrt):
    """Export a trained head to ONNX again and rebuild its engines (after an onnxruntime upgrade,
    or on another CPU)."""
    from specrt.training.pipeline import build_draft

    for d in build_draft(draft_dir, checkpoint, tensorrt=tensorrt):
        click.echo(f"wrote {d}")


@main.command("import-mtp")
@click.option(
    "--model", "checkpoint", required=True, type=click.Path(path_type=Path), help="A checkpoint with MTP modules."
)
@click.option("--out", required=True, type=click.Path(path_type=Path), help="The head's directory (--draft-dir).")
@click.option("--index", default=0, show_default=True, type=click.IntRange(min=0), help="Which MTP module.")
@tensorrt_option(HEAD_TENSORRT)
@_friendly_errors
def import_mtp(checkpoint, out, index, tensorrt):
    """Make a draft head of a multi-token-prediction module the checkpoint carries (DeepSeek-V3's
    layout: num_nextn_predict_layers in config.json), for --draft mtp --draft-dir OUT."""
    from specrt.training.pipeline import import_mtp

    for d in import_mtp(checkpoint, out, index, tensorrt):
        click.echo(f"wrote {d}")
