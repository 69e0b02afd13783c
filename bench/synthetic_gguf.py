"""A GGUF file with Llama-3.1-8B's shapes and random 4-bit blocks: what building and decoding an
8B model costs on this machine, in memory, disk and time (its tokens mean nothing).

    .venv/bin/python bench/synthetic_gguf.py --out models/.cache/synthetic-8b-q4_k_m.gguf

Llama-3.1-8B's shapes: 32 layers, hidden 4096, 32 query and 8 key/value heads of 128, feed-forward
14336, vocabulary 128256 (a byte-level tokenizer of that many tokens: the 256 byte symbols, then
filler tokens, one merge), context 8192 (the model's 131072 would only make the rotary tables
larger). Tensors as a Q4_K_M file lays them out: every matrix Q4_K but the output head and the
value and down projections of every other layer, Q6_K; norms F32. The blocks' codes are random
bytes; their scales are set so that weights have the spread of a trained model's (~0.02), so the
activations stay finite through the layers. Written tensor by tensor (the file is ~4.9 GB; at
most one tensor is in memory), to a temporary name renamed at the end.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import numpy as np

SHAPES = dict(layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=128256, context=8192)
Q4_K, Q6_K = 144, 210  # bytes per block of 256 weights


def byte_symbols() -> list[str]:
    """GPT-2's printable stand-ins for the 256 bytes (what a byte-level BPE vocabulary starts from)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    out, n = dict.fromkeys(keep), 0
    for b in range(256):
        if b not in out:
            out[b] = 256 + n
            n += 1
    return [chr(b if out[b] is None else out[b]) for b in range(256)]


def blocks(rng, rows: int, cols: int, kind: str) -> np.ndarray:
    """(rows, cols / 256 * block bytes) random blocks of `kind` with sane scales."""
    size = Q4_K if kind == "Q4_K" else Q6_K
    raw = rng.integers(0, 256, (rows, cols // 256, size), dtype=np.uint8)
    if kind == "Q4_K":  # d, dmin (f16) lead: w = d * sc * q - dmin * m, sc, m 6-bit, q 4-bit
        raw[..., 0:2] = np.frombuffer(np.float16(1.2e-4).tobytes(), np.uint8)
        raw[..., 2:4] = np.frombuffer(np.float16(8e-4).tobytes(), np.uint8)
    else:  # d (f16) ends the block: w = d * scale * (q - 32), scale int8, q 6-bit
        raw[..., 208:210] = np.frombuffer(np.float16(2e-5).tobytes(), np.uint8)
    return raw.reshape(rows, -1)


def tensors(s: dict):
    """(name, shape in weights (rows, cols), kind) in the file's order."""
    h, f, d = s["hidden"], s["ffn"], s["hidden"] // s["heads"]
    yield "token_embd.weight", (s["vocab"], h), "Q4_K"
    for i in range(s["layers"]):
        big = "Q6_K" if i % 2 == 0 else "Q4_K"
        yield f"blk.{i}.attn_norm.weight", (h,), "F32"
        yield f"blk.{i}.attn_q.weight", (h, h), "Q4_K"
        yield f"blk.{i}.attn_k.weight", (s["kv_heads"] * d, h), "Q4_K"
        yield f"blk.{i}.attn_v.weight", (s["kv_heads"] * d, h), big
        yield f"blk.{i}.attn_output.weight", (h, h), "Q4_K"
        yield f"blk.{i}.ffn_norm.weight", (h,), "F32"
        yield f"blk.{i}.ffn_gate.weight", (f, h), "Q4_K"
        yield f"blk.{i}.ffn_up.weight", (f, h), "Q4_K"
        yield f"blk.{i}.ffn_down.weight", (h, f), big
    yield "output_norm.weight", (h,), "F32"
    yield "output.weight", (s["vocab"], h), "Q6_K"


def write(out: Path, s: dict = SHAPES, seed: int = 0) -> Path:
    import gguf
    from tqdm import tqdm

    tmp = out.with_name(out.name + ".tmp")
    w = gguf.GGUFWriter(str(tmp), "llama")
    w.add_name("synthetic Llama-3.1-8B shapes (random Q4_K_M blocks)")
    w.add_block_count(s["layers"])
    w.add_context_length(s["context"])
    w.add_embedding_length(s["hidden"])
    w.add_feed_forward_length(s["ffn"])
    w.add_head_count(s["heads"])
    w.add_head_count_kv(s["kv_heads"])
    w.add_rope_freq_base(500000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(s["vocab"])
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    tokens = byte_symbols() + ["<|begin_of_text|>", "<|eot_id|>", "ĠĠ"]  # one merge: llama.cpp wants some
    tokens += [f"<filler_{i}>" for i in range(s["vocab"] - len(tokens))]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([1] * 256 + [3, 3] + [1] * (s["vocab"] - 258))
    w.add_token_scores([0.0] * s["vocab"])
    w.add_token_merges(["Ġ Ġ"])
    w.add_bos_token_id(256)
    w.add_eos_token_id(257)
    plan = list(tensors(s))
    for name, shape, kind in plan:
        if kind == "F32":
            w.add_tensor_info(name, shape, np.dtype(np.float32), 4 * shape[0])
        else:
            rows, cols = shape
            nbytes = rows * cols // 256 * (Q4_K if kind == "Q4_K" else Q6_K)
            qtype = gguf.GGMLQuantizationType[kind]
            w.add_tensor_info(name, (rows, nbytes // rows), np.dtype(np.uint8), nbytes, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, shape, kind in tqdm(plan, desc="write", unit="tensor"):
        data = np.ones(shape, np.float32) if kind == "F32" else blocks(rng, *shape, kind)
        w.write_tensor_data(data)
    w.close()
    os.replace(tmp, out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--layers", type=int, default=SHAPES["layers"], help="fewer layers: a smaller file, same widths")
    args = ap.parse_args()
    out = write(args.out, {**SHAPES, "layers": args.layers})
    print(f"{out}: {out.stat().st_size / 1e9:.2f} GB")


if __name__ == "__main__":
    main()
