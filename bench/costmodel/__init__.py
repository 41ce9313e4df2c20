"""The device-free H100 cost model behind ``python -m bench model`` (docs/cost-model.md).

    fake_h100      a CPU-only torch build believes it has one H100 (sm_90); nothing can launch
    capture        Inductor's kernels, extern calls and launch order of each graph, with their bytes
    costs          bytes, launches and FLOPs -> time at an H100's rates (no torch)
    peak_memory    a step's peak memory and saved activations, from the wrappers' allocations (no torch)
    workloads      one contestant of one workload, compiled and captured (a child process's job)
    child          ``python -m bench.costmodel.child SPEC RESULT``: that child process
    cubins         each captured kernel config compiled to an sm_90 cubin: registers, spills, access widths
    calibration    the model against the H100 results stored in bench/results/
"""
