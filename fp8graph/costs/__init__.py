"""Modelled kernel time of a site on a GPU, in BF16 and in an FP8 recipe (``fp8graph.costs.sites``)."""

from fp8graph.costs.gpus import GPU, GPUS, gpu, running_gpu
from fp8graph.costs.sites import SYMBOLIC_TOKENS, SiteTimes, site_times

__all__ = ["GPU", "GPUS", "SYMBOLIC_TOKENS", "SiteTimes", "gpu", "running_gpu", "site_times"]
