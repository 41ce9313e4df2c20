"""Plain-torch FP8 numerics: formats, casts and amaxes, tiles, delayed-scaling math, the health numbers.

The reference every kernel and graph target is checked against; imports nothing else of fp8graph.
"""
