"""Tiny GGUF files written by the tests with the gguf package: float or block-quantized tensors,
q/k rows permuted as llama.cpp's converter does."""

import numpy as np


def _permute(w, n_head):
    """llama.cpp's q/k permutation (convert_hf_to_gguf), the inverse of ours."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def add_tokenizer(w, vocab: int, chat_template: str | None = None) -> None:
    """A byte-pair tokenizer of `vocab` tokens in the file's metadata (three special tokens, then
    one letter each, no merges), as `specrt convert` needs one; with `chat_template`, that too."""
    tokens = ["<unk>", "<|im_start|>", "<|im_end|>"] + [chr(ord("a") + i) for i in range(vocab - 3)]
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3, 3, 3] + [1] * (vocab - 3))
    w.add_token_scores([0.0] * vocab)
    w.add_token_merges([])
    if chat_template is not None:
        w.add_chat_template(chat_template)


def write_gguf(
    model,
    hf,
    path,
    types: dict[str, str] | None = None,
    tokenizer: bool = False,
    chat_template: str | None = None,
    arch: str = "llama",
):
    """`model`'s weights as a GGUF file; types: GGUF role (attn_q, ffn_down, token_embd, output,
    ...) -> block type (Q4_0, Q4_1, Q8_0); other tensors are stored as F32. `tokenizer`: with
    one in its metadata (`add_tokenizer`, and `chat_template`). arch "llama" (q and k rows
    permuted, as llama.cpp stores them) or "qwen2" (as the checkpoint, with its q/k/v biases)."""
    import gguf

    types = types or {}
    w = gguf.GGUFWriter(str(path), arch)
    if tokenizer:
        add_tokenizer(w, hf["vocab_size"], chat_template)
    w.add_block_count(hf["num_hidden_layers"])
    w.add_context_length(hf["max_position_embeddings"])
    w.add_embedding_length(hf["hidden_size"])
    w.add_feed_forward_length(hf["intermediate_size"])
    w.add_head_count(hf["num_attention_heads"])
    w.add_head_count_kv(hf["num_key_value_heads"])
    w.add_rope_freq_base(hf["rope_theta"])
    w.add_layer_norm_rms_eps(hf["rms_norm_eps"])
    w.add_vocab_size(hf["vocab_size"])
    w.add_eos_token_id(2)
    w.add_bos_token_id(1)
    for k, v in model.state_dict().items():
        a = v.numpy().astype(np.float32)
        if k.startswith("layers."):
            _, i, rest = k.split(".", 2)
            mod, leaf = rest.rsplit(".", 1)
            if arch != "llama":
                pass
            elif mod == "self_attn.q_proj":
                a = _permute(a, hf["num_attention_heads"])
            elif mod == "self_attn.k_proj":
                a = _permute(a, hf["num_key_value_heads"])
            role, name = NAMES[mod], f"blk.{i}.{NAMES[mod]}.{leaf}"
        else:
            name = {
                "embed_tokens.weight": "token_embd.weight",
                "norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight",
            }[k]
            role = name.split(".")[0]
        kind = types.get(role) if a.ndim == 2 else None
        if kind is None:
            w.add_tensor(name, np.ascontiguousarray(a))
        else:
            qtype = gguf.GGMLQuantizationType[kind]
            w.add_tensor(name, gguf.quants.quantize(np.ascontiguousarray(a), qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# the bytes of one block of each type, and where its float16 fields sit (scale magnitudes that
# keep a random model's activations of order one)
BLOCK_BYTES = {"Q8_0": 34, "Q5_0": 22, "Q4_K": 144, "Q6_K": 210, "Q5_K": 176, "IQ4_XS": 136}
WEIGHTS_PER_BLOCK = {"Q8_0": 32, "Q5_0": 32, "Q4_K": 256, "Q6_K": 256, "Q5_K": 256, "IQ4_XS": 256}
HALVES = {
    "Q8_0": {0: 2e-3},
    "Q5_0": {0: 8e-3},
    "Q4_K": {0: 3e-4, 2: 1e-3},
    "Q6_K": {208: 6e-5},
    "Q5_K": {0: 2e-4, 2: 1e-3},
    "IQ4_XS": {0: 1e-4},
}


def random_blocks(rows: int, cols: int, kind: str, rng) -> np.ndarray:
    """(rows, row bytes) uint8: random codes and scales of one block type (any bytes are codes;
    the float16 fields are set to finite values)."""
    nb = cols // WEIGHTS_PER_BLOCK[kind]
    raw = rng.integers(0, 256, (rows, nb, BLOCK_BYTES[kind]), dtype=np.uint8)
    for at, scale in HALVES[kind].items():
        half = (rng.uniform(0.5, 1.5, (rows, nb)) * scale).astype(np.float16)
        raw[..., at : at + 2] = half[..., None].view(np.uint8).reshape(rows, nb, 2)
    return raw.reshape(rows, -1)


GEMMA_ROLES = {  # GGUF role -> (rows, cols) of a Gemma 3 layer: hidden C, heads H x D, kv Hkv, F
    "attn_q": lambda c: (c["H"] * c["D"], c["C"]),
    "attn_k": lambda c: (c["Hkv"] * c["D"], c["C"]),
    "attn_v": lambda c: (c["Hkv"] * c["D"], c["C"]),
    "attn_output": lambda c: (c["C"], c["H"] * c["D"]),
    "ffn_gate": lambda c: (c["F"], c["C"]),
    "ffn_up": lambda c: (c["F"], c["C"]),
    "ffn_down": lambda c: (c["C"], c["F"]),
}


def write_gemma3_gguf(
    path, types: dict[str, str], C=256, H=2, Hkv=1, D=128, F=512, layers=3, vocab=160, window=8, tokenizer=False
):
    """A random Gemma 3 GGUF as llama.cpp writes one: norms stored as 1 + w, the embedding tied to
    the head; types: role -> block type (Q8_0, Q5_0, Q4_K, Q6_K), F32 otherwise; `tokenizer`:
    with one in its metadata (`add_tokenizer`)."""
    import gguf

    rng = np.random.default_rng(7)
    dims = dict(C=C, H=H, Hkv=Hkv, D=D, F=F)
    w = gguf.GGUFWriter(str(path), "gemma3")
    if tokenizer:
        add_tokenizer(w, vocab)
    w.add_block_count(layers)
    w.add_context_length(256)
    w.add_embedding_length(C)
    w.add_feed_forward_length(F)
    w.add_head_count(H)
    w.add_head_count_kv(Hkv)
    w.add_key_length(D)
    w.add_value_length(D)
    w.add_rope_freq_base(1_000_000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_sliding_window(window)
    w.add_vocab_size(vocab)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)

    def tensor(name, role, shape):
        kind = types.get(role)
        if kind in (None, "F16"):
            a = (rng.standard_normal(shape) * 0.05).astype(np.float32)
            w.add_tensor(name, a if kind is None else a.astype(np.float16))
        else:
            qtype = gguf.GGMLQuantizationType[kind]
            w.add_tensor(name, random_blocks(*shape, kind, rng), raw_dtype=qtype)

    def norm(name, size):
        w.add_tensor(name, (1.0 + rng.standard_normal(size) * 0.1).astype(np.float32))

    tensor("token_embd.weight", "token_embd", (vocab, C))
    norm("output_norm.weight", C)
    for i in range(layers):
        for role, shape in GEMMA_ROLES.items():
            tensor(f"blk.{i}.{role}.weight", role, shape(dims))
        for role in ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm"):
            norm(f"blk.{i}.{role}.weight", C)
        for role in ("attn_q_norm", "attn_k_norm"):
            norm(f"blk.{i}.{role}.weight", D)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
