"""FSDP2 all-gathers weights in FP8: each rank casts its shard, the graph reads the gathered bytes.

    install         which weights gather in FP8 (and why not), FSDP2's extension set up on their shards
    shard_casts     the cast of a shard before the gather, as the graph would cast the whole weight
    gathered_weight the unsharded parameter FSDP2 builds from the gathered bytes
    graph_check     a gathered weight is read by FP8 sites only
"""
