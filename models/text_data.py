"""Real English text for training runs, from a file that ships with Python.

``pydoc_data.topics`` holds the Python language reference's topic pages as
prose (about 465k characters), written by the Python documentation authors.
Text is encoded as UTF-8 bytes, so a byte-level model needs no tokenizer.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["corpus_bytes", "TextBatches"]


@functools.cache
def corpus_bytes() -> torch.Tensor:
    """The whole corpus as a 1-D uint8 tensor, topics in sorted order."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[name] for name in sorted(topics))
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8)


class TextBatches:
    """Seeded random windows of the corpus as ``(batch, seq_len)`` int64 token ids.

    The last 5% of the corpus is held out for ``split="eval"``. Byte values
    at or above ``vocab_size`` map to ``vocab_size - 1``.
    """

    def __init__(self, batch_size: int, seq_len: int, vocab_size: int = 256, seed: int = 0,
                 split: str = "train"):
        data = corpus_bytes().long().clamp(max=vocab_size - 1)
        cut = int(len(data) * 0.95)
        self.data = data[:cut] if split == "train" else data[cut:]
        self.batch_size, self.seq_len = batch_size, seq_len
        self.generator = torch.Generator().manual_seed(seed)

    def next(self) -> torch.Tensor:
        starts = torch.randint(0, len(self.data) - self.seq_len, (self.batch_size,),
                               generator=self.generator)
        return torch.stack([self.data[s:s + self.seq_len] for s in starts.tolist()])  # (B, T)
