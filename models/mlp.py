"""A toy MLP: ``linear -> gelu -> linear -> gelu -> linear(head)``.

The ``head`` (N=10 classes) stays in high precision with its reason.
"""

import torch
from torch import nn

CONFIGS = {
    "tiny": dict(in_features=64, hidden=128, classes=10),
    "bench": dict(in_features=4096, hidden=14336, classes=10),
}


class ToyMLP(nn.Module):
    def __init__(self, in_features: int, hidden: int, classes: int):
        super().__init__()
        self.up = nn.Linear(in_features, hidden)
        self.mid = nn.Linear(hidden, in_features, bias=False)
        self.head = nn.Linear(in_features, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (..., in_features)
        x = torch.nn.functional.gelu(self.up(x))  # (..., hidden)
        x = torch.nn.functional.gelu(self.mid(x))  # (..., in_features)
        return self.head(x)  # (..., classes)


def build(config: dict) -> ToyMLP:
    return ToyMLP(**config)
