"""A model Dynamo runs eagerly because its recompile limit was reached is reported, not run quietly in BF16."""

import logging

import pytest
import torch

import fp8graph
from fp8graph.inspection.skipped_frames import frames_skipped_since, unimplemented_now


@pytest.fixture
def two_compiles_a_frame():
    """Dynamo's recompile_limit at 2 (8 by default) and a fresh Dynamo before and after: three models of one
    class reach it."""
    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=2):
        yield
    torch._dynamo.reset()


def _sequential(width: int) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(64, width))


def test_a_model_past_dynamos_recompile_limit_is_named_and_explain_says_why_it_sees_no_graph(two_compiles_a_frame,
                                                                                               caplog):
    """Each new model of one class is a compile of the same code: the third runs eagerly, every site in high
    precision, and its first call says so with the limit and what to do; the frame is skipped from then on without
    a new count, so explain of a fourth model of the class gives the likely cause with its error."""
    x = torch.randn(4, 64)
    with caplog.at_level(logging.WARNING, logger="fp8graph"):
        for width in (64, 80):
            compiled = fp8graph.compile(_sequential(width), compiler="aot_eager")
            compiled(x)
            assert compiled.fp8graph_backend.decisions and "eagerly" not in caplog.text
        before = unimplemented_now()
        third = fp8graph.compile(_sequential(96), compiler="aot_eager")
        third(x)
    (skipped,) = frames_skipped_since(before)
    assert skipped.recompile_limit and "recompile_limit (2) reached" in skipped.why
    assert third.fp8graph_backend.decisions == [] and third.fp8graph_backend.frames_run_eagerly == [skipped]
    assert (f"Dynamo ran the call eagerly ({skipped.why}): nothing of it compiled, every site runs in high "
            "precision") in caplog.text
    with pytest.raises(RuntimeError, match=r"captured no graph of Sequential: nothing to explain; Dynamo ran it "
                                           r"eagerly, likely .*recompile_limit"):
        fp8graph.explain(_sequential(112), x)


@pytest.mark.parametrize("reason, named", [
    ("Dynamo recompile limit exceeded\n  Explanation: ... exceeding the accumulated_recompile_limit cache size limit "
     "(currently set to 256). ...\n  Developer debug context: Limit type: accumulated_recompile_limit",
     "Dynamo's accumulated_recompile_limit (256) reached"),
    ("Dynamo cache limit exceeded\n  Explanation: ... exceeding the recompile_limit cache size limit.Giving up on "
     "compiling ...\n  Developer debug context: Limit type: recompile_limit",
     f"Dynamo's recompile_limit ({torch._dynamo.config.recompile_limit}) reached")])
def test_each_limit_is_named_as_dynamo_names_it(reason, named):
    """The limit the reason names, at the value it says (else the config's now), under torch's earlier wording
    too."""
    before = unimplemented_now()
    with pytest.MonkeyPatch.context() as patch:
        counts = type(before)(before)
        counts[reason] += 1
        patch.setitem(torch._dynamo.utils.counters, "unimplemented", counts)
        (skipped,) = frames_skipped_since(before)
    assert skipped.recompile_limit and skipped.why.startswith(named) and skipped.where == "a function"
