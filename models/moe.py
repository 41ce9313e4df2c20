"""A mixture-of-experts block as HuggingFace's ``"grouped_mm"`` experts run it, in plain PyTorch.

    router (linear, N = experts) -> softmax -> top-k -> sort tokens by expert -> gather
    -> grouped_mm(gate_up) -> SwiGLU -> grouped_mm(down) -> weigh by the routing -> scatter back, sum

The same ops, in the same order, as ``transformers.integrations.moe.grouped_mm_experts_forward``
(transformers 5.23), so that a test or benchmark of fp8graph's expert sites sees the graph a
Qwen3-MoE layer gives, at any size, without transformers. ``bench`` is one Qwen3-30B-A3B MoE block
(hidden 2048, 128 experts, top 8, expert width 768). ``weights="ekn"`` stores the expert weights
(E, K, N), as gpt-oss does, instead of HuggingFace's (E, N, K). ``implementation="batched_mm"`` runs the
experts as transformers' ``batched_mm_experts_forward`` does (what ``generate()`` decodes with on a GPU):
each (token, expert) pair's weight picked by index, ``torch.bmm(W[expert_ids], x.unsqueeze(-1))``.
"""

import torch
from torch import nn

CONFIGS = {
    "tiny": dict(hidden=64, experts=4, top_k=2, expert_width=32),
    "tiny-odd": dict(hidden=64, experts=5, top_k=3, expert_width=48),
    "bench": dict(hidden=2048, experts=128, top_k=8, expert_width=768),
}


class MoEBlock(nn.Module):
    def __init__(self, hidden: int, experts: int, top_k: int, expert_width: int, weights: str = "enk",
                 implementation: str = "grouped_mm"):
        super().__init__()
        if weights not in ("enk", "ekn"):
            raise ValueError(f"weights must be 'enk' or 'ekn', got {weights!r}")
        if implementation not in ("grouped_mm", "batched_mm"):
            raise ValueError(f"implementation must be 'grouped_mm' or 'batched_mm', got {implementation!r}")
        self.top_k, self.weights = top_k, weights
        self.gate = nn.Linear(hidden, experts, bias=False)  # the router
        self.experts = Experts(hidden, experts, expert_width, weights, implementation)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:  # (B, T, H)
        tokens = hidden_states.reshape(-1, hidden_states.shape[-1])  # (T', H)
        routing = torch.softmax(self.gate(tokens), dim=-1, dtype=torch.float32)  # (T', E)
        top_k_weights, top_k_index = torch.topk(routing, self.top_k, dim=-1)  # (T', k)
        top_k_weights = (top_k_weights / top_k_weights.sum(-1, keepdim=True)).to(tokens.dtype)
        return self.experts(tokens, top_k_index, top_k_weights).reshape(hidden_states.shape)


class Experts(nn.Module):
    def __init__(self, hidden: int, experts: int, expert_width: int, weights: str, implementation: str):
        super().__init__()
        self.num_experts, self.transposed, self.implementation = experts, weights == "ekn", implementation
        gate_up, down = (2 * expert_width, hidden), (hidden, expert_width)
        if self.transposed:
            gate_up, down = gate_up[::-1], down[::-1]
        self.gate_up_proj = nn.Parameter(torch.randn(experts, *gate_up) * hidden ** -0.5)
        self.down_proj = nn.Parameter(torch.randn(experts, *down) * expert_width ** -0.5)

    def _grouped(self, x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        weight_kn = weight if self.transposed else weight.transpose(-2, -1)  # (E, K, N)
        return torch._grouped_mm(x, weight_kn, offs=offsets)

    def _batched(self, x: torch.Tensor, weight: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        if self.transposed:  # (S, 1, K) x (S, K, N)
            return torch.bmm(x.unsqueeze(1), weight[expert_ids]).squeeze(1)
        return torch.bmm(weight[expert_ids], x.unsqueeze(-1)).squeeze(-1)  # (S, N, K) x (S, K, 1)

    def forward(self, tokens, top_k_index, top_k_weights):  # (T', H), (T', k), (T', k)
        if self.implementation == "batched_mm":
            return self._forward_batched(tokens, top_k_index, top_k_weights)
        top_k = top_k_index.shape[-1]
        expert_ids, perm = torch.sort(top_k_index.reshape(-1))  # (S,), S = T' k
        x = tokens[perm // top_k]  # (S, H): the gather
        counts = torch.histc(expert_ids.float(), bins=self.num_experts, min=0, max=self.num_experts - 1)
        offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)  # (E,)
        gate, up = self._grouped(x, self.gate_up_proj, offsets).chunk(2, dim=-1)  # (S, I) each
        y = self._grouped(torch.nn.functional.silu(gate) * up, self.down_proj, offsets)  # (S, H)
        y = y * top_k_weights.reshape(-1)[perm].unsqueeze(-1)
        inverse = torch.empty_like(perm)
        inverse[perm] = torch.arange(perm.shape[0], device=perm.device)
        return y[inverse].view(tokens.shape[0], top_k, -1).sum(dim=1)  # (T', H): the scatter

    def _forward_batched(self, tokens, top_k_index, top_k_weights):
        top_k = top_k_index.shape[-1]
        x = tokens.repeat_interleave(top_k, dim=0)  # (S, H), pair s = (token s // k, its (s % k)-th expert)
        expert_ids = top_k_index.reshape(-1)
        gate, up = self._batched(x, self.gate_up_proj, expert_ids).chunk(2, dim=-1)
        y = self._batched(torch.nn.functional.silu(gate) * up, self.down_proj, expert_ids)  # (S, H)
        y = y * top_k_weights.reshape(-1).unsqueeze(-1)
        return y.view(tokens.shape[0], top_k, -1).sum(dim=1)


def build(config: dict) -> MoEBlock:
    return MoEBlock(**config)
