"""State fp8graph keeps on the user's modules as buffers: delayed-scaling histories and scales, FP8
weight caches, stats, their snapshots inside checkpoint regions, and the amax reduction across ranks.
"""
