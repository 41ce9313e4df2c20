"""``python -m bench fsdp-comms``: a sharded Llama-3-8B step's communication, modelled from its shapes and the
cost model's layer times (no torch needed, nothing runs)."""

import json

import pytest

from bench import fsdp_comms
from bench.__main__ import main

MODEL = fsdp_comms.Llama3_8B()


def test_a_step_gathers_each_layer_twice_and_fp8_moves_a_byte_a_projection_element():
    projections = 2 * 4096 * 4096 + 2 * 1024 * 4096 + 3 * 14336 * 4096  # q, o; k, v; gate, up, down
    assert MODEL.layer_linears() == projections == 218_103_808
    bf16, fp8 = fsdp_comms.step_bytes(MODEL, False), fsdp_comms.step_bytes(MODEL, True)
    assert bf16["layer_all_gather"] == 2 * 2 * (projections + 2 * 4096)  # before the forward and the backward
    assert bf16["layer_all_gather"] - fp8["layer_all_gather"] == 2 * projections
    assert fp8["layer_reduce_scatter"] == bf16["layer_reduce_scatter"]  # gradients reduce in BF16 either way
    # The embedding stays BF16; lm_head gathers in FP8.
    assert bf16["root_all_gather"] - fp8["root_all_gather"] == 128256 * 4096
    # Block scaling gathers its tiles' scales too: 4 bytes a 128x128 tile.
    block = fsdp_comms.step_bytes(MODEL, True, "block")
    assert block["layer_all_gather"] - fp8["layer_all_gather"] == 2 * 4 * projections / (128 * 128)
    # Row-wise gathers 4 bytes a row: q, o, down 4096 rows; k, v 1024; gate, up 14336.
    rowwise = fsdp_comms.step_bytes(MODEL, True, "rowwise")
    assert rowwise["layer_all_gather"] - fp8["layer_all_gather"] == 2 * 4 * (3 * 4096 + 2 * 1024 + 2 * 14336)
    # MXFP8 gathers both layouts: 2 bytes an element, and an E8M0 byte a block of 32 in each.
    mxfp8 = fsdp_comms.step_bytes(MODEL, True, "mxfp8")
    assert mxfp8["layer_all_gather"] - bf16["layer_all_gather"] == 2 * 2 * projections / 32


def test_weights_whose_shards_split_a_tile_gather_in_bf16_as_install_decides():
    """On 16 ranks k and v hold 64 rows a rank, half a 128-row tile: block scaling gathers them in BF16; lm_head's
    128256 rows are 8016 a rank, whole tiles for neither block nor MXFP8 (32-row blocks)."""
    kv = 2 * 1024 * 4096
    eight, sixteen = (fsdp_comms.step_bytes(MODEL, True, "block", ranks) for ranks in (8, 16))
    assert sixteen["layer_all_gather"] - eight["layer_all_gather"] == 2 * kv * (2 - 1 - 4 / 128 ** 2)
    lm_head = 128256 * 4096
    for recipe in ("block", "mxfp8"):
        assert fsdp_comms.step_bytes(MODEL, True, recipe, 16)["root_all_gather"] == 2 * (2 * lm_head + 4096)
    assert fsdp_comms.step_bytes(MODEL, True, "rowwise", 16)["root_all_gather"] == (
        lm_head + 4 * 128256 + 2 * (lm_head + 4096))


def test_what_the_compute_does_not_hide_is_exposed():
    assert fsdp_comms.exposed_ms(forward_ms=3, backward_ms=6, gather_ms=1, reduce_ms=1) == 0
    assert fsdp_comms.exposed_ms(forward_ms=3, backward_ms=6, gather_ms=4, reduce_ms=4) == 1 + 2


def test_the_table_over_nvlink_hides_the_layers_and_over_infiniband_fp8_gather_shortens_the_step(capsys):
    result = json.loads(fsdp_comms.DECODER_RESULT.read_text())
    rows = {(r["link"], r["recipe"], r["gather"]): r for r in fsdp_comms.table(result)}
    nvlink, infiniband = fsdp_comms.LINKS
    forward, backward = fsdp_comms.layer_compute_ms(result, "bf16")
    assert 0 < forward < backward
    for (link, recipe, gather), row in rows.items():
        assert row["step_ms"] == pytest.approx(MODEL.layers * (row["layer_forward_ms"] + row["layer_backward_ms"])
                                               + row["exposed_ms"])
        if gather == "FP8":
            # Never slower: on NVLink block scaling's FP8 gathers hide behind compute as BF16's do, and the root's
            # lm_head gathers in BF16 (its 16032 rows a rank split 128-row tiles).
            assert row["all_gather_gb"] < rows[(link, recipe, "BF16")]["all_gather_gb"]
            assert row["step_ms"] <= rows[(link, recipe, "BF16")]["step_ms"]
    for recipe in ("current", "delayed", "rowwise", "block"):
        assert rows[(infiniband, recipe, "FP8")]["vs_bf16"] > rows[(infiniband, recipe, "BF16")]["vs_bf16"]
    main(["fsdp-comms"])
    shown = capsys.readouterr().out
    assert shown.startswith("MODELLED") and "| 2 x 8 H100, InfiniBand | delayed | FP8 |" in shown
    assert "| 2 x 8 H100, InfiniBand | rowwise | FP8 |" in shown and "InfiniBand, each recipe's" in shown
