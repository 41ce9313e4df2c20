"""Qwen2 (transformers ``Qwen2ForCausalLM``): Llama-like, with biases on q, k and v projections."""

from transformers import Qwen2Config, Qwen2ForCausalLM

CONFIGS = {
    "tiny": dict(vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                 tie_word_embeddings=True),
    "bench": dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                  num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=2048),
}


def build(config: dict) -> Qwen2ForCausalLM:
    return Qwen2ForCausalLM(Qwen2Config(attn_implementation="sdpa", **config))
