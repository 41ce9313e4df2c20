"""A toy MLP: ``linear -> gelu -> linear -> gelu -> linear(head)``.

The ``head`` (N=10 classes) stays in high precision with its reason. With
``checkpointed`` the two hidden layers run in one ``torch.utils.checkpoint``
region, recomputed in backward.
"""

import torch
import torch.utils.checkpoint
from torch import nn

CONFIGS = {
    "tiny": dict(in_features=64, hidden=128, classes=10),
    "tiny-checkpointed": dict(in_features=64, hidden=128, classes=10, checkpointed=True),
    "bench": dict(in_features=4096, hidden=14336, classes=10),
}


class ToyMLP(nn.Module):
    def __init__(self, in_features: int, hidden: int, classes: int, checkpointed: bool = False):
        super().__init__()
        self.checkpointed = checkpointed
        self.up = nn.Linear(in_features, hidden)
        self.mid = nn.Linear(hidden, in_features, bias=False)
        self.head = nn.Linear(in_features, classes)

    def hidden_layers(self, x: torch.Tensor) -> torch.Tensor:  # x: (..., in_features)
        x = torch.nn.functional.gelu(self.up(x))  # (..., hidden)
        return torch.nn.functional.gelu(self.mid(x))  # (..., in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (..., in_features)
        if self.checkpointed:
            x = torch.utils.checkpoint.checkpoint(self.hidden_layers, x, use_reentrant=False)
        else:
            x = self.hidden_layers(x)
        return self.head(x)  # (..., classes)


def build(config: dict) -> ToyMLP:
    return ToyMLP(**config)
