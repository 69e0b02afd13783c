"""onnxruntime-genai's greedy decoding of given token ids: the anchor of bench_fused.py.

Runs in a Python that has onnxruntime-genai (its own virtualenv: it pins its onnxruntime), so it
imports nothing of specrt. Reads one JSON object from stdin ({"model": DIR, "prompts": [[ids]],
"new_tokens": N}) and prints one JSON object: per prompt the generated ids, the prefill seconds
and the decode tokens/s (EOS ignored: every prompt generates N tokens, as specrt's runs do), and
the process's peak resident memory.
"""

import json
import sys
import time

import onnxruntime_genai as og


def main() -> None:
    job = json.loads(sys.stdin.read())
    model = og.Model(job["model"])
    n = job["new_tokens"]
    out = []
    for ids in job["prompts"]:
        params = og.GeneratorParams(model)
        params.set_search_options(do_sample=False, max_length=len(ids) + n, min_length=len(ids) + n)
        gen = og.Generator(model, params)
        t0 = time.perf_counter()
        gen.append_tokens(ids)
        t1 = time.perf_counter()
        tokens = []
        while not gen.is_done() and len(tokens) < n:
            gen.generate_next_token()
            tokens.append(int(gen.get_next_tokens()[0]))
        t2 = time.perf_counter()
        out.append({"tokens": tokens, "prefill_s": t1 - t0, "decode_tok_s": (len(tokens) - 1) / max(t2 - t1, 1e-9)})
        del gen
    hwm = [line.split()[1] for line in open("/proc/self/status") if line.startswith("VmHWM:")]
    peak = round(int(hwm[0]) / 1024, 1) if hwm else None
    print(json.dumps({"version": og.__version__, "runs": out, "peak_rss_mib": peak}))


if __name__ == "__main__":
    main()
