"""The benchmarks' guards against numbers that are not what they claim, and the profile's kernel categories.

An H100 run timed torchao at 0.37-0.48x BF16 in ``bench linear`` and 1.57x
alone: later contestants had passed Dynamo's recompile limit and ran eagerly.
"""

import json
from pathlib import Path

import pytest
import torch

from bench.profile import CATEGORIES, category, recategorized
from bench.timing import NotCompiled, require_fp8_sites, time_compiled

import fp8graph

CPU = torch.device("cpu")
RESULTS = Path(__file__).parents[2] / "bench" / "results"
H100_PROFILES = sorted((RESULTS / "2026-11-23-h100").glob("profile-*.json"))


def _fresh():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()


def test_a_contestant_past_the_recompile_limit_is_an_error_not_an_eager_timing():
    _fresh()
    compiled = torch.compile(lambda x: x * 2, backend="eager", dynamic=False)
    sizes = iter(range(1, 100))
    with pytest.raises(Exception, match="recompile_limit"):
        time_compiled(lambda: compiled(torch.ones(next(sizes))), CPU, warmup=12, repeats=2)


def test_a_recompile_while_timed_is_an_error():
    _fresh()
    compiled = torch.compile(lambda x: x * 2, backend="eager", dynamic=False)
    calls = iter(range(100))
    with pytest.raises(RuntimeError, match="fail_on_recompile"):
        # Warm-up on one shape, then a new shape while timed.
        time_compiled(lambda: compiled(torch.ones(4 if next(calls) < 3 else 5)), CPU, warmup=3, repeats=2)


def test_a_contestant_that_compiled_nothing_is_an_error():
    _fresh()
    with pytest.raises(NotCompiled, match="compiled no frame"):
        time_compiled(lambda: torch.ones(4) * 2, CPU, warmup=2, repeats=2)


def test_a_compiled_contestant_is_timed():
    _fresh()
    compiled = torch.compile(lambda x: x * 2, backend="eager")
    assert len(time_compiled(lambda: compiled(torch.ones(4)), CPU, warmup=2, repeats=3)) == 3


def test_an_fp8graph_contestant_with_no_site_in_fp8_is_an_error():
    _fresh()
    layer = torch.nn.Sequential(torch.nn.Linear(100, 64))  # K=100: no FP8 GEMM takes it
    compiled = fp8graph.compile(layer, compiler="aot_eager")
    compiled(torch.randn(8, 100))
    with pytest.raises(NotCompiled, match="no site in FP8 on this device: K=100 is not a multiple of 16"):
        require_fp8_sites(compiled)


def test_kernel_names_fall_in_their_categories():
    assert category("nvjet_sm90_qrtst_128x128_128x6_1x2_h_bz_coopA_algo2_TNT") == "gemm fp8"
    assert category("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT") == "gemm other"
    assert category("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26") == "attention"
    assert category("triton_poi_fused__scaled_mm__to_copy_abs_clamp_isinf_mul_sub_t_where_17") == "triton"
    assert category("quantize_blocks_kernel") == "triton"
    # Custom ops' Triton kernels are Triton's too: fp8graph's own and torchao's.
    assert category("transpose_bytes_kernel") == category("record_delayed_kernel") == "triton"
    assert category("quantize_group_columns_placed_kernel") == category("_triton_fp8_rowwise_3d_transpose") == "triton"
    assert category("void at::native::vectorized_elementwise_kernel<8, at::native::CUDAFunctor_add") == "other"
    assert category("aten::_scaled_mm") == "gemm fp8" and category("aten::mm") == "gemm other"


def _gemms_together(by_category: dict) -> dict:
    merged = {name: ms for name, ms in by_category.items() if not name.startswith("gemm")}
    return {**merged, "gemm": sum(ms for name, ms in by_category.items() if name.startswith("gemm"))}


@pytest.mark.parametrize("path", H100_PROFILES, ids=lambda path: path.stem)
def test_categories_agree_with_the_h100_profiles(path):
    """Each top kernel of the H100's profiles, summed by its category here, stays within the
    total the profile recorded for that category. GEMMs are compared as one: the 4-layer
    profiles counted cuBLAS's E4M3 x E5M2 GEMMs (``nvjet_sm90_qrtst``, the HYBRID backward) as
    "gemm other", the 32-layer one as FP8; here every ``q`` operand is FP8."""
    stored_names = {"triton (fused elementwise/reduce/quantize)": "triton"}
    assert path.exists()
    for contestant in json.loads(path.read_text()).values():
        recorded = {stored_names.get(name, name): ms for name, ms in contestant["by_category_ms"].items()}
        assert set(recorded) <= set(CATEGORIES)
        summed = dict.fromkeys(CATEGORIES, 0.0)
        for name, milliseconds, _calls in contestant["top"]:
            summed[category(name)] += milliseconds
        recorded, summed = _gemms_together(recorded), _gemms_together(summed)
        for name, milliseconds in summed.items():
            assert milliseconds <= recorded.get(name, 0.0) + 1e-6, (name, milliseconds, recorded)


def test_an_older_profile_s_custom_triton_kernels_are_moved_from_other_to_triton():
    """Profiles written before custom ops' kernels counted as Triton (the H200's of ec8f139): their top kernels
    that are Triton's move from other; a profile written since is read as it is."""
    measured = json.loads((RESULTS / "moe-2026-11-27T132818Z.json").read_text())
    delayed = next(row["profile"] for row in measured["rows"] if row["contestant"] == "delayed")
    moved = sum(ms for name, ms, _ in delayed["top"] if name in ("transpose_bytes_kernel", "record_delayed_kernel"))
    assert moved > 2.0  # 1.12 + 1.02 ms
    by_category = recategorized(delayed)
    assert by_category["triton"] == pytest.approx(delayed["by_category_ms"]["triton"] + moved)
    assert by_category["other"] == pytest.approx(delayed["by_category_ms"]["other"] - moved)
    assert sum(by_category.values()) == pytest.approx(delayed["total_ms"])
    assert recategorized({**delayed, "custom_kernels_as_triton": True}) == delayed["by_category_ms"]
