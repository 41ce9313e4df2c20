"""Llama (transformers ``LlamaForCausalLM``): SwiGLU MLP, grouped-query attention, no biases.

``tiny`` has a 250-token vocabulary on purpose: ``lm_head`` (N=250) is the
site that stays in high precision with its reason.
"""

from transformers import LlamaConfig, LlamaForCausalLM

_COMMON = dict(rms_norm_eps=1e-5, tie_word_embeddings=False, attn_implementation="sdpa")

CONFIGS = {
    "tiny": dict(vocab_size=250, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256),
    # Every projection a multiple of 128, for block scaling's 128x128 weight tiles.
    "tiny-blocks": dict(vocab_size=250, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256),
    # Byte-level language model for the demo: every projection is FP8-eligible.
    "demo": dict(vocab_size=256, hidden_size=128, intermediate_size=352, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512),
    # Benchmark shapes of Llama-3-8B layers, a few of them (``bench decoder --layers`` sets how many).
    "bench-8b-layer": dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                           num_hidden_layers=4, num_attention_heads=32, num_key_value_heads=8,
                           max_position_embeddings=4096),
    # The whole Llama-3-8B shape: 32 layers, its 128256-token vocabulary (about 40 GB peak
    # training at sequence 4096 in BF16).
    "llama3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                      num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                      max_position_embeddings=8192),
}


def build(config: dict) -> LlamaForCausalLM:
    return LlamaForCausalLM(LlamaConfig(**_COMMON, **config))
