"""GPT-2 (transformers ``GPT2LMHeadModel``): Conv1D projections stored (in, out), run by ``torch.addmm``.

``tiny`` uses eager attention, so its two activation-by-activation matmuls per
layer (scores and weighted values) show up as sites kept in high precision.
"""

from transformers import GPT2Config, GPT2LMHeadModel

CONFIGS = {
    "tiny": dict(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=256, bos_token_id=0, eos_token_id=0,
                 attn_implementation="eager"),
    "bench": dict(vocab_size=50257, n_embd=768, n_layer=12, n_head=12, n_positions=1024,
                  attn_implementation="sdpa"),
}


def build(config: dict) -> GPT2LMHeadModel:
    # Dropout off so compiled and eager runs see the same arithmetic.
    return GPT2LMHeadModel(GPT2Config(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **config))
