"""Make a CPU-only torch build believe it has one H100 (sm_90, 132 SMs), for Inductor's code generation only.

Nothing here can run a CUDA kernel: tensors on "cuda" must be FakeTensors (``to_fake_cuda``). Call
``install()`` once, in a process of its own, before anything compiles. Every patch below works around one
place where torch 2.13.0+cpu / triton 3.6.0 asks the (absent) CUDA runtime something. They are private
APIs, so ``install()`` refuses any other torch or triton (``SUPPORTED``) rather than model a step wrongly;
``docs/cost-model.md`` lists the patches and what to check after an upgrade.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import types

import torch

H100 = types.SimpleNamespace(  # what torch.cuda.get_device_properties returns on an H100 80GB HBM3 (SXM)
    name="NVIDIA H100 80GB HBM3", major=9, minor=0, total_memory=80 * 2**30, multi_processor_count=132,
    is_integrated=False, is_multi_gpu_board=False, max_threads_per_multi_processor=2048,
    max_threads_per_block=1024, regs_per_multiprocessor=65536, warp_size=32, L2_cache_size=50 * 2**20,
    shared_memory_per_block=48 * 1024, shared_memory_per_multiprocessor=228 * 1024,
    shared_memory_per_block_optin=227 * 1024, clock_rate=1980000, memory_clock_rate=2619000,
    memory_bus_width=5120, gcnArchName="NV", uuid="00000000-0000-0000-0000-000000000000",
    pci_bus_id=0, pci_device_id=0, pci_domain_id=0,
)


# The versions whose private APIs the patches below and capture.py were written against and checked on.
SUPPORTED = {"torch": "2.13.0", "triton": "3.6.0"}


class UnsupportedVersion(RuntimeError):
    """torch or triton is not the version the fake device and the capture hooks were built for."""


def check_versions() -> None:
    """Refuse a torch or triton other than :data:`SUPPORTED`: a patch that no longer applies could make the
    model silently wrong (attention decomposed into Triton kernels, no launches found)."""
    import triton

    found = {"torch": torch.__version__.split("+")[0], "triton": triton.__version__}
    if torch.cuda.is_available() and not getattr(torch.cuda, "_fp8graph_fake_h100", False):
        raise UnsupportedVersion("the cost model fakes an H100 on a CPU-only torch build; this torch has CUDA "
                                 f"({torch.__version__}): run it with the CPU build the project pins")
    wrong = {name: version for name, version in found.items() if version != SUPPORTED[name]}
    if wrong:
        raise UnsupportedVersion(
            "the cost model hooks private APIs of " + ", ".join(f"{k} {v}" for k, v in SUPPORTED.items()) +
            "; found " + ", ".join(f"{k} {v}" for k, v in wrong.items()) + ". Install those (scripts/setup), "
            "or port the patches and check them as docs/cost-model.md says before changing SUPPORTED")


def cache_root() -> str:
    """Where the C++ shim is built: the user's cache, never the repository."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "fp8graph-costmodel")


def _shim_path() -> str:
    """The C++ shim, built with g++ on first use, keyed by its source and the torch it links against."""
    source = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fake_cuda_guard.cpp")
    torch_dir = os.path.dirname(torch.__file__)
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    with open(source, "rb") as f:
        key = hashlib.sha256(f.read() + f"{torch.__version__} {torch_dir} {abi}".encode()).hexdigest()[:16]
    library = os.path.join(cache_root(), f"libfake_cuda_guard-{torch.__version__}-{key}.so")
    if os.path.exists(library):
        return library
    os.makedirs(cache_root(), exist_ok=True)
    partial = f"{library}.{os.getpid()}.tmp"  # renamed into place: concurrent first uses never load half a file
    command = ["g++", "-shared", "-fPIC", "-O1", "-std=c++17", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
               f"-I{torch_dir}/include", source, f"-L{torch_dir}/lib", "-lc10", "-ltorch_cpu",
               f"-Wl,-rpath,{torch_dir}/lib", "-o", partial]
    try:
        subprocess.run(command, check=True, capture_output=True, text=True)
    except FileNotFoundError:
        raise RuntimeError("the cost model needs g++ to build its C++ shim (fake_cuda_guard.cpp)") from None
    except subprocess.CalledProcessError as error:
        raise RuntimeError(f"building fake_cuda_guard.cpp failed:\n{error.stderr[-3000:]}") from None
    os.replace(partial, library)
    return library


def _load_shim() -> None:
    """A CUDA device guard (c10's FakeGuardImpl) and CUDA hooks that say hasCUDA(), from fake_cuda_guard.cpp.

    Without them autograd aborts the process (an exception thrown through a noexcept) at the first
    FakeTensor on "cuda" that requires grad: InputMetadata asks the CUDA guard for the current stream.
    """
    import ctypes

    handle = ctypes.CDLL(_shim_path(), mode=ctypes.RTLD_GLOBAL)
    if handle.fake_cuda_guard_registered() != 1:
        raise RuntimeError("fake_h100: the CUDA device guard did not register")
    if handle.fake_cuda_swap_hooks() != 1 or handle.fake_cuda_has_cuda() != 1:
        raise RuntimeError("fake_h100: could not make ATen's CUDA hooks report a CUDA device")


_sdpa_library = None


def _use_cudnn_attention() -> None:
    """F.scaled_dot_product_attention on "cuda" calls cuDNN's fused op, as the H100 did.

    SDPA picks its fused kernel in C++ (``_fused_sdp_choice``), which a CPU-only build lacks: it would
    silently decompose to the math path (bmm + softmax over S x S scores, as Triton kernels). The stored
    H100 profiles show cuDNN's flash kernels, so an AutogradCUDA kernel for SDPA calls that op instead.
    """
    global _sdpa_library
    aten = torch.ops.aten

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None, enable_gqa=False):
        lse = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
        return aten._scaled_dot_product_cudnn_attention(query, key, value, attn_mask, lse, dropout_p, is_causal,
                                                        False, scale=scale)[0]

    _sdpa_library = torch.library.Library("aten", "IMPL")
    _sdpa_library.impl("scaled_dot_product_attention", sdpa, "AutogradCUDA")


class _DeviceContext:
    def __init__(self, device=None):
        self.idx = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _patch_torch_cuda() -> None:
    """torch.cuda answers as for one H100 (Inductor, fp8graph and torchao ask capability and properties)."""
    cuda = torch.cuda
    answers = {
        "is_available": lambda: True, "device_count": lambda: 1, "current_device": lambda: 0,
        "set_device": lambda device: None, "synchronize": lambda device=None: None,
        "get_device_capability": lambda device=None: (H100.major, H100.minor),
        "get_device_properties": lambda device=None: H100, "get_device_name": lambda device=None: H100.name,
        "is_bf16_supported": lambda including_emulation=True: True, "is_initialized": lambda: True,
        "_lazy_init": lambda: None, "_exchange_device": lambda device: 0, "_maybe_exchange_device": lambda device: 0,
        "device": _DeviceContext, "_DeviceGuard": _DeviceContext, "memory_allocated": lambda device=None: 0,
        "get_rng_state": lambda device="cuda": torch.zeros(16, dtype=torch.uint8),
        "set_rng_state": lambda new_state, device="cuda": None,
        "get_rng_state_all": lambda: [torch.zeros(16, dtype=torch.uint8)], "set_rng_state_all": lambda states: None,
        "manual_seed": lambda seed: None, "manual_seed_all": lambda seed: None, "seed": lambda: None,
        "seed_all": lambda: None,
    }
    for name, value in answers.items():
        setattr(cuda, name, value)
    cuda._fp8graph_fake_h100 = True  # check_versions: this "CUDA" is the fake one
    import torch.cuda.random as cuda_random

    cuda_random.get_rng_state, cuda_random.set_rng_state = cuda.get_rng_state, cuda.set_rng_state
    for name, fn in {"_cuda_getCurrentRawStream": lambda device: 0, "_cuda_getDevice": lambda: 0,
                     "_cuda_getDeviceCount": lambda: 1}.items():
        if not hasattr(torch._C, name):
            setattr(torch._C, name, fn)


def _patch_dynamo_device_interface() -> None:
    """Dynamo's and Inductor's view of "cuda" (properties, capability, streams) without the CUDA runtime."""
    from torch._dynamo import device_interface as di

    class FakeCudaInterface(di.CudaInterface):
        device = _DeviceContext

        class Worker:
            set_device = staticmethod(lambda device: None)
            current_device = staticmethod(lambda: 0)
            get_device_properties = staticmethod(lambda device=None: H100)

        current_device = staticmethod(lambda: 0)
        set_device = staticmethod(lambda device: None)
        device_count = staticmethod(lambda: 1)
        synchronize = staticmethod(lambda device=None: None)
        get_device_properties = staticmethod(lambda device=None: H100)
        get_raw_stream = staticmethod(lambda device: 0)
        exchange_device = staticmethod(lambda device: 0)
        maybe_exchange_device = staticmethod(lambda device: 0)
        memory_allocated = staticmethod(lambda device=None: 0)
        is_bf16_supported = staticmethod(lambda including_emulation=False: True)
        is_available = staticmethod(lambda: True)
        get_compute_capability = staticmethod(lambda device=None: H100.major * 10 + H100.minor)
        is_triton_capable = staticmethod(lambda device=None: True)

    di.get_interface_for_device("cpu")  # registers the real interfaces first, so ours is not overwritten
    di.register_interface_for_device("cuda", FakeCudaInterface)
    di.register_interface_for_device("cuda:0", FakeCudaInterface)
    di.caching_worker_device_properties["cuda"] = [H100]
    di.caching_worker_current_devices["cuda"] = 0


def _patch_triton_driver() -> None:
    """Triton's active driver reports an sm_90 target and has no libcuda: Inductor can hash its backend
    and Triton can compile to PTX and cubin (``cubins``), but nothing can be loaded or launched."""
    from triton.backends.nvidia.driver import CudaDriver

    import triton.runtime.driver  # noqa: F401  (the package attribute of that name is the DriverConfig)

    triton_driver = sys.modules["triton.runtime.driver"]

    class _NoUtils:
        def __getattr__(self, name):
            raise RuntimeError(f"fake_h100: no CUDA driver here (CudaUtils.{name})")

    class FakeCudaDriver(CudaDriver):
        def __init__(self):  # CudaDriver.__init__ would load libcuda
            self.utils = _NoUtils()
            self.launcher_cls = None
            self.get_device_capability = lambda device=None: (H100.major, H100.minor)
            self.get_current_stream = lambda idx=None: 0
            self.get_current_device = lambda: 0
            self.set_current_device = lambda device: None

        @staticmethod
        def is_active():
            return True

    triton_driver.driver.set_active(FakeCudaDriver())
    triton_driver.driver._default = triton_driver.driver._active


def _patch_constant_folding() -> None:
    """Places where tracing or Inductor evaluate small constants for real, on the (absent) device."""
    # FakeTensorMode may materialise torch.tensor(data, device="cuda") on the device when
    # torch.cuda.is_available() (now True); here it must build it on the CPU and lift it, its own path for
    # machines without the device.
    from torch._subclasses import fake_tensor

    fake_tensor.FakeTensorMode.avoid_device_init = property(lambda self: True)

    # make_fx (AOTAutograd) constant-propagates small constants by running ops on real tensors: a move of
    # such a constant to "cuda" (_to_copy / prims.device_put) would allocate there. Trace those moves.
    from torch.fx.experimental import proxy_tensor

    original_proxy_call = proxy_tensor.proxy_call
    moves = (torch.ops.prims.device_put.default, torch.ops.aten._to_copy.default)

    def to_cuda(func, args, kwargs):
        if func not in moves:
            return False
        device = kwargs.get("device", args[1] if func is moves[0] and len(args) > 1 else None)
        return device is not None and torch.device(device).type == "cuda"

    def proxy_call(proxy_mode, func, pre_dispatch, args, kwargs):
        if not to_cuda(func, args, kwargs):
            return original_proxy_call(proxy_mode, func, pre_dispatch, args, kwargs)
        limit, proxy_tensor.CONSTANT_NUMEL_LIMIT = proxy_tensor.CONSTANT_NUMEL_LIMIT, -1
        try:
            return original_proxy_call(proxy_mode, func, pre_dispatch, args, kwargs)
        finally:
            proxy_tensor.CONSTANT_NUMEL_LIMIT = limit

    proxy_tensor.proxy_call = proxy_call

    # Inductor's randperm/index_add patterns are traced with make_fx on the input device, and randperm on
    # "cuda" needs the CUDA library: trace them on the CPU (they then never match a CUDA graph).
    from torch._inductor.fx_passes import misc_patterns

    original_misc_init = misc_patterns._misc_patterns_init

    def misc_patterns_init(input_device=None):
        if input_device is not None and torch.device(input_device).type == "cuda":
            input_device = torch.device("cpu")
        return original_misc_init(input_device)

    misc_patterns._misc_patterns_init = misc_patterns_init

    # The joint-graph pass constant_fold_uniform_value evaluates full()-like constants as one-element
    # tensors on their device: evaluate them on the CPU (the replacement node keeps its FakeTensor's device).
    from torch._inductor.fx_passes import joint_graph

    folder = joint_graph.UniformValueConstantFolder
    original_deduce = folder._deduce_value

    def deduce_value(self, node):
        device = node.kwargs.get("device") if node.op == "call_function" else None
        if device is not None and torch.device(device).type == "cuda":
            kwargs = node.kwargs
            node.kwargs = {**kwargs, "device": torch.device("cpu")}
            try:
                return original_deduce(self, node)
            finally:
                node.kwargs = kwargs
        if node.op == "call_function" and node.target is torch.ops.prims.device_put.default:
            value = self.env.get(node.args[0]) if isinstance(node.args[0], torch.fx.Node) else None
            return value if isinstance(value, torch.Tensor) else self.unknown_value
        return original_deduce(self, node)

    folder._deduce_value = deduce_value


class NeedsDevice(RuntimeError):
    """Inductor wants a decision only a measurement on the device can make: the step cannot be modelled."""


def _refuse_padding_benchmarks() -> None:
    """Inductor's pad_mm pass decides whether to pad a compute-bound mm whose dimensions are not aligned (e.g. a
    router of 4 experts, N = 4) by timing it padded and unpadded on the device. Nothing can be timed here,
    and either answer changes the kernels: refuse the step with the shapes, instead of the CUDA library's
    "Could not run 'aten::empty.memory_format' with arguments from the 'CUDA' backend". The benchmark is
    reached only past the pass's cheap checks (aligned shapes, not compute-bound, force_shape_pad), through
    its cache lookup, which is where it is stopped."""
    from torch._inductor.fx_passes import pad_mm

    def refuse(key):
        raise NeedsDevice("Inductor's pad_mm pass would time a misaligned mm padded and unpadded on the device to "
                          f"decide whether to pad it ({str(key)[:300]}): the cost model cannot decide for it; "
                          "use dimensions that are multiples of 8 (BF16)")

    pad_mm.get_cached_should_pad = refuse


_installed = False


def install() -> None:
    """Apply every patch (once per process), after checking the versions they were written for."""
    global _installed
    if _installed:
        return
    check_versions()
    _installed = True
    _load_shim()
    _use_cudnn_attention()
    _patch_torch_cuda()
    _patch_dynamo_device_interface()
    _patch_triton_driver()
    _patch_constant_folding()
    _refuse_padding_benchmarks()
    from torch.utils import _triton  # answers cached before install() said "no GPU"

    for name in ("has_triton", "_device_supports_tma", "has_triton_tma_device", "has_triton_experimental_host_tma",
                 "has_triton_stable_tma_api", "has_triton_tensor_descriptor_host_tma"):
        fn = getattr(_triton, name, None)
        if fn is not None and hasattr(fn, "cache_clear"):
            fn.cache_clear()


def to_fake_cuda(module: torch.nn.Module, fake_mode) -> torch.nn.Module:
    """``module``'s parameters and buffers (built on "meta") as uninitialised FakeTensors on "cuda".

    ``module.to("cuda")`` cannot: FakeTensorMode refuses real or meta tensor arguments, and random
    initialisation on "cuda" needs the CUDA library. Values do not matter: only shapes are computed.
    """
    def convert(t):
        with fake_mode:
            return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cuda")

    return module._apply(convert)
