"""``fp8graph::gathered_gemv``: each token's row times its own expert's FP8 weight, the weights read in place.

A mixture-of-experts decode step (transformers' ``batched_mm`` experts) multiplies every selected
(token, expert) pair as ``torch.bmm(W[expert_ids], x.unsqueeze(-1))``: the index copies each pair's
expert weight (S, N, K) before the batched GEMM reads it again, and there is no FP8 batched GEMM to
read FP8 copies. This op takes the experts' FP8 weights (E, N, K) as they are stored and the ids::

    output[s] = (x_fp8[s] . weight_fp8[ids[s]]^T) * x_inverse_scale[s] * weight_inverse_scale[ids[s]]   (N,)

with dequantization factors per row of ``x`` (S,) and per expert and output row of the weight (E, N)
(a per-tensor or per-expert scale expanded). On CUDA it runs ``gathered_gemv_kernel``
(``_gathered_gemv_triton``); everywhere else :func:`reference_gathered_gemv`, which widens the FP8
operands to fp32 (products of FP8 values are exact there) and which the tests hold the kernel to up to
the order of the fp32 sums.
"""

from __future__ import annotations

import torch

from fp8graph.kernels.quantize_tiles import KernelLaunch, triton_available

__all__ = ["gathered_gemv", "plan_gathered_gemv", "reference_gathered_gemv"]

# 32 output rows of 256 bytes: 16-byte loads along K, 64 fp32 partial sums a thread with 4 warps.
_BLOCK_N, _BLOCK_K, _NUM_WARPS = 32, 256, 4
_FP8 = torch.float8_e4m3fn


def _check(x_fp8, x_inverse_scale, weight_fp8, weight_inverse_scale, expert_ids) -> None:
    if x_fp8.dtype != _FP8 or weight_fp8.dtype != _FP8:
        raise ValueError(f"gathered_gemv takes E4M3 operands, got {x_fp8.dtype} and {weight_fp8.dtype}")
    if x_fp8.dim() != 2 or weight_fp8.dim() != 3 or x_fp8.shape[1] != weight_fp8.shape[2]:
        raise ValueError(f"gathered_gemv multiplies x (S, K) by weights (E, N, K), got {tuple(x_fp8.shape)} "
                         f"and {tuple(weight_fp8.shape)}")
    if expert_ids.shape != x_fp8.shape[:1] or expert_ids.is_floating_point():
        raise ValueError(f"gathered_gemv needs one integer expert id per row of x, got {expert_ids.dtype} "
                         f"{tuple(expert_ids.shape)} for {x_fp8.shape[0]} rows")
    if x_inverse_scale.shape != x_fp8.shape[:1] or weight_inverse_scale.shape != weight_fp8.shape[:2]:
        raise ValueError(f"gathered_gemv's scales are (S,) and (E, N), got {tuple(x_inverse_scale.shape)} and "
                         f"{tuple(weight_inverse_scale.shape)}")


def reference_gathered_gemv(x_fp8: torch.Tensor, x_inverse_scale: torch.Tensor, weight_fp8: torch.Tensor,
                            weight_inverse_scale: torch.Tensor, expert_ids: torch.Tensor,
                            out_dtype: torch.dtype) -> torch.Tensor:
    """The op's arithmetic in plain torch: the selected weights widened to fp32 (S, N, K), one batched GEMM."""
    weights_fp32 = weight_fp8.view(torch.uint8)[expert_ids].view(weight_fp8.dtype).to(torch.float32)
    products = torch.bmm(weights_fp32, x_fp8.to(torch.float32)[:, :, None])[:, :, 0]  # (S, N)
    return (products * x_inverse_scale[:, None] * weight_inverse_scale[expert_ids]).to(out_dtype)


def plan_gathered_gemv(x_fp8: torch.Tensor, x_inverse_scale: torch.Tensor, weight_fp8: torch.Tensor,
                       weight_inverse_scale: torch.Tensor, expert_ids: torch.Tensor,
                       out_dtype: torch.dtype) -> tuple[KernelLaunch, torch.Tensor]:
    """The launch that writes the op's (S, N) output, and that output."""
    from triton import cdiv

    from fp8graph.kernels._gathered_gemv_triton import gathered_gemv_kernel

    _check(x_fp8, x_inverse_scale, weight_fp8, weight_inverse_scale, expert_ids)
    # The kernel walks K with unit stride (a (E, K, N) weight is made (E, N, K) once, where it is cast).
    x_fp8 = x_fp8 if x_fp8.stride(1) == 1 else x_fp8.contiguous()
    weight_fp8 = weight_fp8 if weight_fp8.stride(2) == 1 else weight_fp8.contiguous()
    x_inverse_scale = x_inverse_scale.to(torch.float32).contiguous()
    weight_inverse_scale = weight_inverse_scale.to(torch.float32)
    if weight_inverse_scale.stride(1) != 1:
        weight_inverse_scale = weight_inverse_scale.contiguous()
    rows, (_, columns, depth) = x_fp8.shape[0], weight_fp8.shape
    output = torch.empty((rows, columns), dtype=out_dtype, device=x_fp8.device)
    launch = KernelLaunch(
        gathered_gemv_kernel, (rows, cdiv(columns, _BLOCK_N)),
        (x_fp8.view(torch.uint8), x_inverse_scale, weight_fp8.view(torch.uint8), weight_inverse_scale,
         expert_ids.contiguous(), output, columns, x_fp8.stride(0), weight_fp8.stride(0), weight_fp8.stride(1),
         weight_inverse_scale.stride(0), output.stride(0)),
        {"K": depth, "BLOCK_N": _BLOCK_N, "BLOCK_K": _BLOCK_K, "num_warps": _NUM_WARPS})
    return launch, output


def gathered_gemv_triton(*operands) -> torch.Tensor:
    """Run the Triton kernel (the op's arguments)."""
    launch, output = plan_gathered_gemv(*operands)
    if output.numel():
        launch()
    return output


@torch.library.custom_op("fp8graph::gathered_gemv", mutates_args=())
def gathered_gemv(x_fp8: torch.Tensor, x_inverse_scale: torch.Tensor, weight_fp8: torch.Tensor,
                  weight_inverse_scale: torch.Tensor, expert_ids: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``(S, N)`` in ``out_dtype``: row ``s`` of ``x_fp8`` (S, K) times expert ``expert_ids[s]``'s rows of
    ``weight_fp8`` (E, N, K), dequantized (see the module's doc)."""
    _check(x_fp8, x_inverse_scale, weight_fp8, weight_inverse_scale, expert_ids)
    return reference_gathered_gemv(x_fp8, x_inverse_scale, weight_fp8, weight_inverse_scale, expert_ids, out_dtype)


@gathered_gemv.register_fake
def _(x_fp8, x_inverse_scale, weight_fp8, weight_inverse_scale, expert_ids, out_dtype):
    return x_fp8.new_empty((x_fp8.shape[0], weight_fp8.shape[1]), dtype=out_dtype)


@gathered_gemv.register_kernel("cuda")
def _(x_fp8, x_inverse_scale, weight_fp8, weight_inverse_scale, expert_ids, out_dtype):
    if not triton_available():  # choose_lowering refuses FP8 decode on CUDA without Triton: never reached there
        raise RuntimeError("fp8graph::gathered_gemv on CUDA needs Triton")
    return gathered_gemv_triton(x_fp8, x_inverse_scale, weight_fp8, weight_inverse_scale, expert_ids, out_dtype)
