"""The functions the rewrite puts in the graph (FP8 linear, tiled linear, matmul) and what AOTAutograd
needs of them: the partitioner's marks and the cache keys.
"""
