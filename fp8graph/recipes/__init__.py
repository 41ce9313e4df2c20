"""What a site's FP8 is: the scaling recipes (``scaling``) and the policy that assigns them per module
(``policy``). The recipes are re-exported here, so ``fp8graph.recipes.DelayedScaling`` and
``fp8graph.recipes.PRESETS`` read as they did when this was one module (the benchmarks import them so,
which keeps them running on the commits the GPU measured)."""

from fp8graph.recipes.scaling import (FP8_GEMM_DIM_MULTIPLE, PRESETS, DelayedScaling, Float8BlockScaling,
                                      Float8CurrentScaling, Float8RowwiseScaling, MXFP8BlockScaling, Recipe,
                                      TiledRecipe)

__all__ = ["FP8_GEMM_DIM_MULTIPLE", "DelayedScaling", "Float8BlockScaling", "Float8CurrentScaling",
           "Float8RowwiseScaling", "MXFP8BlockScaling", "PRESETS", "Recipe", "TiledRecipe"]
