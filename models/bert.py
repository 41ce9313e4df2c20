"""BERT (transformers ``BertForSequenceClassification``): encoder with biases everywhere.

The 3-way classifier (N=3) stays in high precision with its reason.
"""

from transformers import BertConfig, BertForSequenceClassification

CONFIGS = {
    "tiny": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, max_position_embeddings=256, num_labels=3),
    "bench": dict(vocab_size=30522, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                  num_attention_heads=12, max_position_embeddings=512, num_labels=3),
}


def build(config: dict) -> BertForSequenceClassification:
    return BertForSequenceClassification(BertConfig(
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, attn_implementation="sdpa", **config))
