"""What the bench scripts share: their usual arguments, the result envelope, a server to measure.

    ap = bench_arguments(__doc__, artifacts=True, prompts=True)      # --artifacts --prompts --out
    result = {**envelope("onnxruntime", "numpy"), "rows": ...}      # date, commit, machine, versions
    print(f"wrote {write_result_json(result, args.out, 'name')}")
    with running_server(args.artifacts, ["--draft", "suffix"]) as base_url: ...

Every script writes its JSON through specrt.benchmark.write_result_json (atomically, under
bench/results/ by default) with this envelope first, so every result says when, where, on which
commit and with which versions it was measured.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = ROOT / "artifacts" / "SmolLM2-135M-Instruct"
MODEL = ROOT / "models" / "SmolLM2-135M-Instruct"
PROMPTS = ROOT / "bench" / "prompts.jsonl"
RESULTS = ROOT / "bench" / "results"


def bench_arguments(doc: str | None, artifacts: bool = True, model: bool = False, prompts: bool = False):
    """An ArgumentParser with the script's docstring and the arguments most scripts take:
    --artifacts, --model, --prompts (as asked, each defaulting to the repository's own) and --out."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    if artifacts:
        ap.add_argument("--artifacts", type=Path, default=ARTIFACTS, help="build-engines output.")
    if model:
        ap.add_argument("--model", type=Path, default=MODEL, help="The checkpoint.")
    if prompts:
        ap.add_argument("--prompts", type=Path, default=PROMPTS, help="JSON lines with 'prompt' (and 'class').")
    ap.add_argument("--out", type=Path, default=RESULTS, help="Where the JSON (and plots) go.")
    return ap


def envelope(*packages: str, **machine) -> dict:
    """The fields every result starts with: date (UTC), the commit of the code measured, machine
    (CPU model, CPU count, and what the script adds) and the versions of Python, specrt and
    `packages`."""
    from specrt.artifacts import cpu_model, package_versions, source_commit

    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": source_commit(),
        "machine": {"cpu": cpu_model(), "cpus": os.cpu_count(), **machine},
        "versions": package_versions(*packages),
    }


def write_results(name: str, result: dict) -> Path:
    """`result` as bench/results/<name>.json (indented; <name>-2.json and on where an earlier run
    of the day holds the name: results are never overwritten), said on stdout; returns the path."""
    import json

    RESULTS.mkdir(exist_ok=True)
    path, n = RESULTS / f"{name}.json", 2
    while path.exists():
        path, n = RESULTS / f"{name}-{n}.json", n + 1
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    os.replace(tmp, path)
    print(f"wrote {path}")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_server(artifacts: Path, options: list[str], log: Path | None = None, wait_s: float = 120.0):
    """`specrt serve --artifacts ARTIFACTS OPTIONS...` on a free loopback port, its output in
    `log` (or discarded); yields its base URL once GET /health answers, stops it on exit."""
    port = free_port()
    cmd = [sys.executable, "-m", "specrt.cli", "serve", "--artifacts", str(artifacts), "--port", str(port), *options]
    sink = log.open("w") if log is not None else subprocess.DEVNULL
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT if log else subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.1)
            if proc.poll() is not None:
                said = log.read_text()[-2000:] if log is not None else proc.stderr.read()[-2000:]
                raise SystemExit(f"the server exited: {said}")
            if time.monotonic() > deadline:
                raise SystemExit(f"the server did not answer /health within {wait_s:.0f} s")
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        if log is not None:
            sink.close()
