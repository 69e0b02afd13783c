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


def write_gguf(model, hf, path, types: dict[str, str] | None = None):
    """`model`'s weights as a GGUF file; types: GGUF role (attn_q, ffn_down, token_embd, output,
    ...) -> block type (Q4_0, Q4_1, Q8_0); other tensors are stored as F32."""
    import gguf

    types = types or {}
    w = gguf.GGUFWriter(str(path), "llama")
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
            if mod == "self_attn.q_proj":
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
