"""Commands that run a model: generate, serve (one engine or Ray Serve replicas), bench."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click

from specrt.cli.common import (
    SERVER,
    FiniteFloat,
    _friendly_errors,
    _parse_fixed_n,
    _parse_methods,
    engine_options,
    main,
    memory_mb,
    open_chosen,
    precision_options,
)
from specrt.errors import SpecrtError
from specrt.server.limits import SPEC_DECODE_METRICS, ServerLimits

if TYPE_CHECKING:
    from specrt.runtime.runner import RunnerSpec


@main.command()
@click.argument("prompt", required=False)
@click.option("--prompt", "prompt_opt", help="Prompt text (or give it as the argument; '-' reads stdin).")
@engine_options()
@click.option("--max-new-tokens", default=128, show_default=True, type=click.IntRange(min=1))
@click.option("--temperature", default=0.0, show_default=True, type=FiniteFloat(0.0), help="0 is greedy.")
@click.option("--top-k", default=0, show_default=True, type=click.IntRange(min=0), help="0 disables.")
@click.option("--top-p", default=1.0, show_default=True, type=FiniteFloat(0.0, 1.0, lo_open=True), help="1 disables.")
@click.option("--seed", type=click.IntRange(min=0), default=None, help="Seed for sampling (an integer >= 0).")
@click.option(
    "--chat/--no-chat", default=True, show_default=True, help="Apply the model's chat template to the prompt."
)
@click.option("--system", default=None, help="System message (chat mode).")
@click.option(
    "--json-schema",
    "json_schema",
    type=click.Path(dir_okay=False),
    default=None,
    help="Structured output: the answer is JSON valid under the JSON schema in this file.",
)
@click.option("--regex", default=None, help="Structured output: the whole answer matches this regular expression.")
@_friendly_errors
def generate(
    choice,
    prompt,
    prompt_opt,
    max_new_tokens,
    temperature,
    top_k,
    top_p,
    seed,
    chat,
    system,
    json_schema,
    regex,
):
    """Generate text, streaming it as it is produced; ends with token counts and tokens/s
    (and, with --draft, the speculative decoding metrics)."""
    from specrt.runtime.sampling import SamplingParams

    text = prompt_opt if prompt_opt is not None else prompt
    if text is None:
        raise click.UsageError("give a prompt: specrt generate --artifacts DIR --prompt 'Hello'")
    if text == "-":
        text = sys.stdin.read()
    sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    grammar = _grammar(json_schema, regex)
    gen, runner = open_chosen(choice)
    stream = runner.stream(text, max_new_tokens, sampling, chat=chat, system=system, grammar=grammar)
    for piece in stream:
        click.echo(piece, nl=False)
        sys.stdout.flush()
    result = stream.result
    click.echo()
    sys.stdout.flush()
    click.echo(f"[{gen.backend.description}] {result.summary()}", err=True)
    if result.metrics is not None:
        click.echo(f"[{choice.draft} draft, num_draft={choice.num_draft}] {result.metrics.summary()}", err=True)


def _grammar(json_schema: str | None, regex: str | None):
    """The constraint of --json-schema FILE or --regex (runtime/grammar.py); None without one."""
    from specrt.runtime.grammar import Grammar

    if json_schema and regex:
        raise click.UsageError("give --json-schema or --regex, not both")
    if regex is not None:
        return Grammar.regex(regex)
    if json_schema is None:
        return None
    try:
        text = Path(json_schema).read_text(encoding="utf-8")
    except OSError as e:
        raise click.BadParameter(f"cannot read {json_schema}: {e.strerror}", param_hint="--json-schema") from None
    except UnicodeDecodeError as e:
        raise click.BadParameter(
            f"{json_schema} is not UTF-8 text (byte {e.start}); save the schema as UTF-8 JSON",
            param_hint="--json-schema",
        ) from None
    return Grammar.json_schema(text)


@main.command()
@engine_options(draft="auto")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on (0.0.0.0: every interface).")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(1, 65535))
@click.option(
    "--served-model-name", default=None, help="Model id clients send (default: the checkpoint directory's name)."
)
@click.option(
    "--max-tokens",
    "max_tokens_limit",
    default=1024,
    show_default=True,
    type=click.IntRange(min=1),
    help="Largest max_tokens a request may ask for (and the default).",
)
@click.option(
    "--max-body-kb",
    default=1024,
    show_default=True,
    type=click.IntRange(min=1),
    help="Largest request body; larger ones get 413.",
)
@click.option(
    "--max-queue",
    default=SERVER.max_queue,
    show_default=True,
    type=click.IntRange(min=0),
    help="Requests that may wait for a slot; more get 503.",
)
@click.option(
    "--max-batch",
    default=SERVER.max_batch,
    show_default=True,
    type=click.IntRange(min=1),
    help="Requests generating together (continuous batching); 1 serves one at a time.",
)
@click.option(
    "--prefill-budget",
    default=SERVER.prefill_budget,
    show_default=True,
    type=click.IntRange(min=1),
    help="Prompt tokens prefilled per step while other requests decode (a newcomer's prompt in chunks).",
)
@click.option(
    "--prefix-cache-mb",
    default=SERVER.prefix_cache_mb,
    show_default=True,
    type=click.IntRange(min=0),
    callback=memory_mb,
    help="Memory for the KV of earlier prompts' blocks, reused by requests that start with them (0: off; at most "
    "the machine's RAM).",
)
@click.option(
    "--request-timeout",
    default=SERVER.request_timeout,
    show_default=True,
    type=FiniteFloat(0.0, lo_open=True),
    help="Seconds a request may take from arrival; past it the request ends with 504.",
)
@click.option(
    "--per-request-spec-decode-metrics",
    "spec_decode_metrics",
    default=SERVER.spec_decode_metrics,
    show_default=True,
    type=click.Choice(SPEC_DECODE_METRICS),
    help="Each response's draft acceptance under metrics.speculative_decoding, with vLLM's fields (detailed: "
    "also per step); n = 1 answers only.",
)
@click.option("--ray", "use_ray", is_flag=True, help="Serve --replicas engines behind Ray Serve (the ray extra).")
@click.option("--replicas", default=2, show_default=True, type=click.IntRange(min=1), help="With --ray: engines.")
@click.option("--ray-address", default=None, help="With --ray: a running Ray cluster to join (default: start one).")
@_friendly_errors
def serve(
    choice,
    host,
    port,
    served_model_name,
    max_tokens_limit,
    max_body_kb,
    max_queue,
    max_batch,
    prefill_budget,
    prefix_cache_mb,
    request_timeout,
    spec_decode_metrics,
    use_ray,
    replicas,
    ray_address,
):
    """Serve the model over an OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions,
    /v1/models, streaming included), with speculative decoding (--draft auto by default: per row
    and step the copy draft that serves it best, or none where drafting does not pay; --draft
    none for plain decoding), on one engine or on several behind Ray Serve (--ray --replicas N)."""
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        raise SpecrtError(
            "the server needs fastapi and uvicorn: pip install 'specrt[server]' (make setup installs them)"
        ) from None
    from specrt.server import bind_socket

    limits = ServerLimits(
        max_body_bytes=max_body_kb << 10,
        max_tokens=max_tokens_limit,
        max_queue=max_queue,
        max_batch=max_batch,
        prefill_budget=prefill_budget,
        prefix_cache_mb=prefix_cache_mb,
        request_timeout=request_timeout,
        spec_decode_metrics=spec_decode_metrics,
    )
    sock = bind_socket(host, port)  # before the engine loads: a taken port is said at once
    if use_ray:
        sock.close()  # Ray Serve's proxy listens; it was only checked to be free
        _serve_ray(choice, served_model_name, limits, host, port, replicas, ray_address)
        return
    try:
        gen, runner = open_chosen(choice)
        service = _service(gen, runner, choice, served_model_name, limits)
    except BaseException:
        sock.close()
        raise
    url_host = f"[{host}]" if ":" in host else host
    from specrt.runtime.runner import described

    click.echo(f"serving {service.model_id!r} on http://{url_host}:{port} [{described(gen, choice)}]", err=True)
    for note in service.notes:
        click.echo(note, err=True)
    from specrt.server import serve as run_server

    run_server(service, sock)


def _service(gen, runner, choice: RunnerSpec, served_model_name, limits):
    from specrt.server import CompletionService

    name = served_model_name or Path(gen.checkpoint or choice.checkpoint or choice.artifacts or choice.engine).name
    return CompletionService(runner, name, limits)


def _serve_ray(choice: RunnerSpec, served_model_name, limits, host, port, replicas, address) -> None:
    """`serve --ray`: replicas of the engine behind Ray Serve's proxy (server/ray.py)."""
    import os

    try:
        import ray  # noqa: F401
        from ray import serve as _  # noqa: F401
    except ImportError:
        raise SpecrtError("--ray needs Ray Serve: pip install 'specrt[ray]' (or pip install 'ray[serve]')") from None
    from specrt.server.ray import serve_ray

    cpus = max(1, (os.cpu_count() or 1) // replicas)  # per replica; its ONNX Runtime threads match
    if choice.threads == 0:
        choice = dataclasses.replace(choice, threads=cpus)
    if address is None:  # one machine: load the engine here first, so a bad option fails before Ray starts
        gen, _ = open_chosen(choice)
        from specrt.runtime.runner import described

        what = described(gen, choice)
        del gen
    else:
        what = choice.draft

    def make_service():
        gen, runner = open_chosen(choice)
        return _service(gen, runner, choice, served_model_name, limits)

    url_host = f"[{host}]" if ":" in host else host
    click.echo(f"serving {replicas} replicas on http://{url_host}:{port} via Ray Serve [{what}]", err=True)
    serve_ray(make_service, replicas, host, port, cpus, limits.max_batch + limits.max_queue, address=address)


@main.command()
@click.option(
    "--artifacts",
    type=click.Path(path_type=Path),
    default=Path("artifacts/SmolLM2-135M-Instruct"),
    show_default=True,
    help="Artifact directory from build-engines.",
)
@click.option(
    "--model",
    "checkpoint",
    type=click.Path(path_type=Path),
    default=None,
    help="Checkpoint (default: the one the engine was built from).",
)
@click.option(
    "--prompts",
    type=click.Path(path_type=Path),
    default=Path("bench/prompts.jsonl"),
    show_default=True,
    help="JSON lines with 'class' and 'prompt'.",
)
@click.option(
    "--out",
    type=click.Path(path_type=Path),
    default=Path("bench/results"),
    show_default=True,
    help="Where the JSON and the PNG go.",
)
@click.option("--max-new-tokens", default=192, show_default=True, type=click.IntRange(min=1))
@click.option("--repeats", default=2, show_default=True, type=click.IntRange(min=1))
@click.option("--no-transformers", is_flag=True, help="Skip the transformers baselines.")
@click.option("--quick", is_flag=True, help="One repeat, 48 tokens, N in {2, 4}: a smoke run.")
@click.option("--sweep-only", is_flag=True, help="Only the speedup-vs-N sweep and its plot.")
@click.option("--no-sweep", is_flag=True, help="Skip the speedup-vs-N sweep.")
@click.option(
    "--fixed-n",
    default="4,8",
    show_default=True,
    help="Fixed draft lengths for ngram, suffix and lookahead ('' for none).",
)
@click.option(
    "--methods",
    default="ngram,suffix,auto,lookahead",
    show_default=True,
    help="Draft methods run beside plain decoding, comma-separated (any of --draft's lookups).",
)
@precision_options
@click.option(
    "--drafts",
    type=click.Path(path_type=Path),
    default=None,
    help="A `make drafts` directory (drafts/MODEL): also run its heads (chains, trees) and auto with each.",
)
@_friendly_errors
def bench(
    artifacts,
    checkpoint,
    prompts,
    out,
    max_new_tokens,
    repeats,
    no_transformers,
    quick,
    sweep_only,
    no_sweep,
    fixed_n,
    methods,
    quantize,
    split,
    drafts,
):
    """Benchmark speculative decoding on a prompt set: table, JSON and a speedup-vs-N plot."""
    from specrt.benchmark import SpecBenchConfig, format_table, run_spec_benchmark, write_results
    from specrt.layout import ArtifactLayout

    cfg = SpecBenchConfig(
        engine_dir=ArtifactLayout(artifacts).ort_engine(),
        checkpoint=checkpoint,
        prompts=prompts,
        out_dir=out,
        max_new_tokens=max_new_tokens,
        repeats=repeats,
        transformers=not no_transformers,
        main_runs=not sweep_only,
        sweep=not no_sweep,
        fixed_n=_parse_fixed_n(fixed_n),
        methods=_parse_methods(methods),
        artifacts=artifacts,
        quantize=quantize,
        split=split,
        drafts=drafts,
    )
    if quick:
        cfg = dataclasses.replace(cfg, repeats=1, max_new_tokens=48, fixed_n=(4,), sweep_n=(2, 4))
    result = run_spec_benchmark(cfg, log=lambda line: click.echo(line, err=True))
    click.echo(format_table(result))
    sweep = result["sweep"]
    if sweep["measured"]:
        click.echo(
            f"\nsweep ({sweep['method']}, {sweep['class']}): "
            + "  ".join(
                f"N={n}: {m:.2f}x (model {p:.2f}x)"
                for n, m, p in zip(
                    sweep["n"], sweep["measured"], sweep["predicted"] or [float("nan")] * len(sweep["n"])
                )
            )
        )
    json_path, png = write_results(result, out)
    click.echo(f"wrote {json_path}" + (f" and {png}" if png else ""))
