"""How a scaled GEMM runs: the implementation choice (``Lowering``), padding, native tiled GEMMs.
"""
