"""The modelled step's memory (bench.costmodel.peak_memory): a wrapper's allocations replayed, graphs chained."""

import pytest

from bench.costmodel import peak_memory
from bench.costmodel.peak_memory import GraphMemory

MB = 1 << 20

# A backward's call, as Inductor writes it: an owned input (getitem_3, 4 MB) freed by its last reader, a kept one
# (primals_1), a buffer reused in place, a view, a custom op returning two tensors, and what it returns.
BACKWARD = """def call(self, args):
        primals_1, getitem_3, tangents_1 = args
        args.clear()
        with torch.cuda._DeviceGuard(0):
            buf0 = empty_strided_cuda((1024, 1024), (1024, 1), torch.float32)
            triton_poi_fused_0.run(getitem_3, tangents_1, buf0, 1048576, stream=raw_stream0)
            del getitem_3
            buf1 = buf0; del buf0  # reuse
            buf2 = reinterpret_tensor(buf1, (1048576, ), (1, ), 0); del buf1  # reuse
            buf3 = torch.ops.fp8graph.quantize.default(buf2, primals_1)
            buf4 = buf3[0]
            buf5 = buf3[1]
            del buf3
            del buf2
            buf6 = empty_strided_cuda((2048, 1024), (1, 2048), torch.bfloat16)
            extern_kernels.mm(buf4, primals_1, out=buf6)
            del buf4
            return (buf6, buf5, reinterpret_tensor(primals_1, (4, ), (1, ), 0), )
class Runner:
    def recursively_apply_fns(self, fns):
        return [fn(self) for fn in fns]
"""


def test_a_backward_s_allocations_are_replayed_as_its_wrapper_runs_them():
    memory = peak_memory.graph_memory(BACKWARD, True, {"primals_1": 8 * MB, "getitem_3": 4 * MB, "tangents_1": MB},
                                      {"buf3": [MB, 64]})
    # getitem_3 (4) + buf0 (4) live at the first kernel; getitem_3 freed; the op's outputs (1 MB + 64 B) beside
    # buf2 (4); buf2 freed, buf6 (4) beside buf4 and buf5: the peak is 8 MB.
    assert memory == GraphMemory(peak=8 * MB, end=4 * MB + 64, owned=4 * MB, tangents=MB)


def test_a_forward_owns_none_of_its_inputs():
    memory = peak_memory.graph_memory(BACKWARD, False, {"primals_1": 8 * MB, "getitem_3": 4 * MB}, {"buf3": [MB, 64]})
    assert memory.owned == 0 and memory.tangents == 0
    # buf2 (4 MB) beside the op's outputs; buf2 freed before buf6 (4 MB) is made, beside buf4 (1 MB) and buf5
    assert memory.peak == 5 * MB + 64


def test_a_buffer_the_replay_cannot_read_is_an_error_not_a_free_buffer():
    with pytest.raises(ValueError, match="buf7 = torch.ops.aten.sort"):
        peak_memory.graph_memory("def call(self, args):\n    buf7 = torch.ops.aten.sort.stable(x)\n    return (buf7, )",
                                 False, {}, {})
    with pytest.raises(ValueError, match="dynamic shape"):
        peak_memory.graph_memory("def call(self, args):\n    buf0 = empty_strided_cuda((s0, 4), (4, 1), "
                                 "torch.float32)\n    return (buf0, )", False, {}, {})
    with pytest.raises(ValueError, match="unpacked from a call"):  # a CUDA-graph partition's outputs
        peak_memory.graph_memory("def call(self, args):\n    primals_1, = args\n    buf0, buf1 = "
                                 "self.partitions[0](partition0_args)\n    return (buf0, )", False, {}, {})
    with pytest.raises(ValueError, match="return"):
        peak_memory.graph_memory("def call(self, args):\n    buf0 = empty_strided_cuda((4, ), (1, ), torch.int8)",
                                 False, {}, {})


def test_a_strided_allocation_spans_its_largest_offset():
    assert peak_memory.storage_bytes((3, 4), (1, 3), "bfloat16") == 24
    assert peak_memory.storage_bytes((2, 1, 4), (8, 0, 1), "float8_e4m3fn") == 12
    assert peak_memory.storage_bytes((0, 4), (4, 1), "float32") == 0


def test_graphs_chain_forwards_in_order_then_backwards_in_reverse():
    """Two regions: the second's backward runs first and takes the user's gradient (counted while it runs); the
    first's takes the gradient the second returned, freed after it."""
    forward_a = GraphMemory(peak=10, end=6, owned=0)
    backward_a = GraphMemory(peak=20, end=3, owned=6, tangents=2)
    forward_b = GraphMemory(peak=30, end=9, owned=0)
    backward_b = GraphMemory(peak=40, end=2 + 5, owned=9, tangents=1)  # returns a's gradient (2) and weights' (5)
    call = peak_memory.call_memory([("forward", 1, forward_a), ("backward", 1, backward_a),
                                    ("forward", 1, forward_b), ("backward", 1, backward_b)])
    # forwards: 10, then 6 + 30; b's backward: 15 + 1 - 9 + 40 = 47; then live 15 - 9 + 7 = 13;
    # a's backward: 13 - 6 + 20 = 27, then 13 + 3 - 6 - 2 = 8: the gradients (5 + 3).
    assert call == {"peak": 47, "grads": 8, "saved": 15}


def test_a_graph_run_per_layer_counts_each_run():
    layer_forward = GraphMemory(peak=4, end=3, owned=0)
    layer_backward = GraphMemory(peak=5, end=2, owned=3, tangents=1)
    call = peak_memory.call_memory([("forward", 3, layer_forward), ("backward", 3, layer_backward)])
    # forwards: 4, 3 + 4, 6 + 4, leaving 9; backwards: 9 + 1 - 3 + 5 = 12, leaving 8; 8 - 3 + 5, leaving 6;
    # 6 - 3 + 5, leaving 4: three runs' 2 bytes each, less the 1 byte passed to each of the two later runs.
    assert call == {"peak": 12, "grads": 4, "saved": 9}


def test_later_micro_batches_hold_the_first_one_s_gradients():
    calls = {"first": {"peak": 10, "grads": 4, "saved": 6}, "reuse": {"peak": 8, "grads": 4, "saved": 5},
             "per call": {"peak": 9, "grads": 4, "saved": 6}}
    assert peak_memory.step_memory(100, calls, 1) == {"peak_bytes": 109, "saved_bytes": 6}
    assert peak_memory.step_memory(100, calls, 4) == {"peak_bytes": 112, "saved_bytes": 6}
    without_reuse = {"first": calls["first"]}
    assert peak_memory.step_memory(100, without_reuse, 2) == {"peak_bytes": 114, "saved_bytes": 6}
