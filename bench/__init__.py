"""fp8graph benchmarks: ``python -m bench <workload> [--smoke]``; results go to bench/results/."""
