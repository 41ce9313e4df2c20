"""fp8graph: FP8 training and inference for PyTorch as a torch.compile backend.

    compiled = torch.compile(model, backend="fp8")           # every eligible linear in FP8
    compiled = fp8graph.compile(model, policy=fp8graph.Float8CurrentScaling())
    print(fp8graph.explain(model, input_ids))                 # what was rewritten, and why not
    print(fp8graph.plan(model, policy))                       # what each weight will get, before tracing
    with fp8graph.weights_unchanged(compiled): ...            # micro-batches that share each weight's FP8 cast
    fp8graph.save_fp8(compiled, "fp8_checkpoint")             # the FP8 weights as trained, for serving engines
"""

from fp8graph import policies
from fp8graph.api import compile, explain
from fp8graph.buffers.kept_casts import weights_unchanged
from fp8graph.export import load_fp8, save_fp8
from fp8graph.recipes.plan import Plan, plan
from fp8graph.numerics.formats import Format
from fp8graph.recipes.policy import Policy
from fp8graph.recipes.scaling import DelayedScaling, Float8BlockScaling, Float8CurrentScaling, Float8RowwiseScaling, MXFP8BlockScaling
from fp8graph.inspection.report import ExplainReport, SiteRecord

__all__ = [
    "DelayedScaling",
    "ExplainReport",
    "Float8BlockScaling",
    "Float8CurrentScaling",
    "Float8RowwiseScaling",
    "Format",
    "MXFP8BlockScaling",
    "Plan",
    "Policy",
    "SiteRecord",
    "compile",
    "explain",
    "load_fp8",
    "plan",
    "policies",
    "save_fp8",
    "weights_unchanged",
]
__version__ = "0.1.0"
