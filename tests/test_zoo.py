"""Every family of the model zoo (``fp8graph.models.zoo``) against plain ``torch.compile``, in BF16 and fp32.

One test per family and dtype, so xdist spreads them; each compiles three times (fp8graph keeping every
site, plain torch.compile, fp8graph's default FP8 policy), all with aot_eager but the fp32 FP8 check, on 2x8
tokens:

    keep-all   fp8graph's logits, loss and every parameter gradient bit for bit equal to torch.compile's, both
               compiling the whole model as one graph (plain torch.compile of a whole 2-layer BF16 Llama is
               not bit-exact with per-layer graphs, fp8graph's default, so only one graph on each side compares);
               torch.compile's side by the digest of its outputs where one is kept for this environment
               (tests/zoo_plain_digests.py)
    fp8        logits and gradients finite; logits' SQNR against eager in the same dtype (so the reference
               carries the dtype's own rounding and the SQNR measures what FP8 adds) above the family's floor;
               the fp32 loss after one SGD step (lr 0.1) within the family's margin of eager's after it
    coverage   every nn.Linear / Conv1D the model uses named by a decision, rewritten or kept with a reason

The fp32 FP8 check runs fp8graph's rewritten graph with its ``eager`` compiler: the same values as aot_eager
(SQNR and loss equal to the last digit on Llama, T5 and JetMoE), a quarter to half of the time, and AOTAutograd's
trace of each family's FP8 graph is the BF16 check's. Both dtypes' keep-all checks trace through AOTAutograd.

and, on three families, fp8graph's default per-layer regions keeping every site against torch.compile of
each layer, bit for bit.
"""

import pytest
import torch

from fp8graph.models.zoo import (FAMILIES, UNAVAILABLE, build_zoo_model, check_family, linear_paths,
                                 regional_keep_all_mismatches, zoo_inputs)

import zoo_plain_digests

DTYPES = (torch.bfloat16, torch.float32)

# Logits' SQNR against eager, dB. Measured 22.2-29.6 dB for every family but two, in both dtypes.
DEFAULT_SQNR_FLOOR_DB = 20.0
SQNR_FLOOR_DB = {
    # Two layers, and a norm after each attention and MLP output (sandwich norm) that scales the branch, its FP8
    # error included, up to the residual's size: measured 18.9-19.2 dB (Gemma 2 with one layer: 22.2 dB).
    "gemma2": 16.0,
    "gemma3": 16.0,
}

# The loss after one SGD step, relative to eager's. Measured at most 0.43% for every family but T5.
DEFAULT_LOSS_MARGIN = 0.01
LOSS_MARGIN = {
    # T5's logits at initialization are large (loss 7.0, against 5.5 for a uniform guess over 256 tokens), so
    # one relative FP8 error moves its loss more: measured 0.85% in BF16, 0.2% in fp32.
    "t5": 0.03,
}


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda dtype: str(dtype).removeprefix("torch."))
@pytest.mark.parametrize("family", FAMILIES)
def test_family_against_plain_compile(family, dtype):
    result = check_family(family, dtype, plain_digest=zoo_plain_digests.kept_digest(family, dtype),
                          fp8_compiler="aot_eager" if dtype == torch.bfloat16 else "eager")
    zoo_plain_digests.keep(family, dtype, result.plain_digest)
    failures = result.failures(SQNR_FLOOR_DB.get(family, DEFAULT_SQNR_FLOOR_DB),
                               LOSS_MARGIN.get(family, DEFAULT_LOSS_MARGIN))
    assert not failures, f"{family} {result.dtype}:\n" + "\n".join(failures)
    assert result.sites_rewritten > 0


@pytest.mark.parametrize("family", ["llama", "deepseek_v3", "glm4_moe"])
def test_the_default_per_layer_path_keeping_every_site_equals_torch_compile_of_each_layer(family):
    # The family test compares whole-model graphs; this one fp8graph's default regions, two layers in BF16,
    # where plain torch.compile of the whole model differs from per-layer graphs (GLM-4-MoE: 27 dB).
    model = build_zoo_model(family, torch.bfloat16, layers=2)
    assert regional_keep_all_mismatches(model, zoo_inputs(family)) == []


def test_every_linear_of_the_tiny_configs_is_fp8_eligible():
    """K and N multiples of 16, but for the routers and gates whose N is an expert count or 1."""
    for family in FAMILIES:
        model = build_zoo_model(family, torch.float32)
        modules = dict(model.named_modules())
        odd = [path for path in linear_paths(model) if any(size % 16 for size in modules[path].weight.shape)]
        assert all(path.endswith(("router", "router.layer", "shared_expert_gate")) for path in odd), (family, odd)


def test_inputs_fit_the_vocabulary_and_seq2seq_decoders_start_shifted():
    inputs = zoo_inputs("t5", batch=2, sequence=8)
    assert inputs["input_ids"].shape == (2, 8) and inputs["labels"].shape == (2, 4)
    assert torch.equal(inputs["decoder_input_ids"][:, 1:], inputs["labels"][:, :-1])
    assert set(zoo_inputs("llama")) == {"input_ids", "labels"}


def test_unavailable_families_are_not_in_the_table_and_say_why():
    assert not set(UNAVAILABLE) & set(FAMILIES)
    assert all(reason for reason in UNAVAILABLE.values())
    assert len(FAMILIES) >= 36


def test_a_kept_digest_of_plain_compile_stands_for_it_and_no_other_does():
    """The keep-all check compiles plain torch.compile only when the kept digest is not that of fp8graph's
    outputs: the digest of plain's outputs is fp8graph keep-all's; another model's outputs miss it."""
    from fp8graph.models.zoo import _keep_all_against_plain

    inputs = zoo_inputs("llama")
    model = build_zoo_model("llama", torch.float32, layers=1)
    mismatches, plain_digest = _keep_all_against_plain(model, inputs, "0" * 64)  # no such digest: plain runs
    assert mismatches == [] and plain_digest is not None
    assert _keep_all_against_plain(model, inputs, plain_digest) == ([], None)  # equal: plain not compiled
    other = build_zoo_model("llama", torch.float32, seed=1, layers=1)
    assert _keep_all_against_plain(other, inputs, plain_digest)[1] not in (None, plain_digest)


def test_plain_digests_are_kept_only_when_asked_and_only_for_this_environment(tmp_path, monkeypatch):
    monkeypatch.setattr(zoo_plain_digests, "PATH", tmp_path / "digests.json")
    monkeypatch.delenv(zoo_plain_digests.KEEP, raising=False)
    zoo_plain_digests.keep("llama", torch.float32, "a" * 64)
    assert zoo_plain_digests.kept_digest("llama", torch.float32) is None
    monkeypatch.setenv(zoo_plain_digests.KEEP, "1")
    zoo_plain_digests.keep("llama", torch.float32, "a" * 64)
    zoo_plain_digests.keep("gpt2", torch.float32, "b" * 64)
    assert zoo_plain_digests.kept_digest("llama", torch.float32) == "a" * 64
    assert zoo_plain_digests.kept_digest("llama", torch.bfloat16) is None
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)  # another thread count may reduce in another order: not kept for it
        assert zoo_plain_digests.kept_digest("llama", torch.float32) is None
    finally:
        torch.set_num_threads(threads)
    # Another vendor's MKL and oneDNN may round otherwise: not kept for it either.
    vendor = zoo_plain_digests._cpu_vendor()
    monkeypatch.setattr(zoo_plain_digests, "_cpu_vendor", lambda: "Another" + vendor)
    assert zoo_plain_digests.kept_digest("llama", torch.float32) is None
    assert [p.name for p in tmp_path.iterdir()] == ["digests.json"]
