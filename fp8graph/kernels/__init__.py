"""Hand-written kernels, each a ``torch.library`` custom op with a plain-torch reference."""
