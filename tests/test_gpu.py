"""On a CUDA GPU with FP8 (SM >= 8.9): ``_scaled_mm`` agrees with the exact emulation."""

import pytest
import torch

import fp8graph
from fp8graph import Float8CurrentScaling
from fp8graph.formats import Role
from fp8graph.linear_fp8 import linear_fp8_target
from fp8graph.lowering import Lowering, choose_lowering, scaled_gemm
from fp8graph.metrics import sqnr_db
from fp8graph.models import build
from fp8graph.quantize import quantize_current

pytestmark = pytest.mark.gpu
HYBRID = Float8CurrentScaling()


def test_auto_lowering_picks_scaled_mm_on_cuda():
    assert choose_lowering(torch.device("cuda")) is Lowering.SCALED_MM


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("b_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_scaled_mm_matches_emulation(out_dtype, b_dtype):
    a_hp = torch.randn(256, 512, device="cuda")
    b_hp = torch.randn(384, 512, device="cuda")
    a_fp8, a_scale = quantize_current(a_hp, torch.float8_e4m3fn)
    b_fp8, b_scale = quantize_current(b_hp, b_dtype)
    on_gpu = scaled_gemm(a_fp8, a_scale, b_fp8.t(), b_scale, out_dtype, Lowering.SCALED_MM)
    emulated = scaled_gemm(a_fp8, a_scale, b_fp8.t(), b_scale, torch.float32, Lowering.EMULATED)
    # Same FP8 products; only accumulation order (and the output rounding) differ.
    assert sqnr_db(emulated, on_gpu.float()) > (45 if out_dtype == torch.bfloat16 else 70)


@pytest.mark.parametrize("tokens", [512, 17])  # 17: the weight-gradient GEMM needs K padding
def test_linear_three_gemms_match_emulation(tokens):
    input_hp = torch.randn(tokens, 256, device="cuda", dtype=torch.bfloat16)
    weight_hp = torch.randn(384, 256, device="cuda", dtype=torch.bfloat16)
    grad_output = torch.randn(tokens, 384, device="cuda", dtype=torch.bfloat16)
    results = {}
    for lowering in (Lowering.SCALED_MM, Lowering.EMULATED):
        x = input_hp.clone().requires_grad_()
        w = weight_hp.clone().requires_grad_()
        out = linear_fp8_target(HYBRID, lowering)(x, w)
        out.backward(grad_output)
        results[lowering] = (out.float(), x.grad.float(), w.grad.float())
    for gpu, emulated in zip(results[Lowering.SCALED_MM], results[Lowering.EMULATED]):
        assert sqnr_db(emulated, gpu) > 40


def test_inductor_compiled_model_on_gpu_uses_scaled_mm():
    model = build("llama", "tiny").cuda()
    compiled = fp8graph.compile(model)
    tokens = torch.randint(0, 250, (2, 64), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = compiled(tokens, labels=tokens).loss
    loss.backward()
    assert torch.isfinite(loss)
    lowerings = {d.lowering for d in compiled.fp8graph_backend.decisions if d.rewritten}
    assert lowerings == {Lowering.SCALED_MM}
