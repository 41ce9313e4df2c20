"""Compile a Triton kernel launch for a GPU this machine does not have.

Triton 3.6 compiles to PTX and, with the ``ptxas`` it ships, to a cubin for any
``GPUTarget`` without a GPU. :func:`compile_launch` specializes the launch's
arguments exactly as ``kernel[grid](...)`` would at run time (constexprs,
16-byte alignment of pointers and divisibility of integers, integers equal to
1), so what compiles here is what a GPU run would compile.
"""

from __future__ import annotations

GPU_CAPABILITIES = {"sm_90": 90, "sm_100": 100}


def compile_launch(launch, capability: int):
    """The ``CompiledKernel`` of ``launch`` (an ``fp8graph.kernels.quantize_tiles.KernelLaunch``) for sm_<capability>."""
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile, make_backend
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", capability, 32)
    backend = make_backend(target)
    kernel = launch.kernel
    kwargs = {**launch.constexprs, "debug": kernel.debug or knobs.runtime.debug,
              "instrumentation_mode": knobs.compilation.instrumentation_mode}
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound_args, specialization, options = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound_args, specialization, options)
    return compile(ASTSource(kernel, signature, constexprs, attrs), target=target, options=options.__dict__)


def resource_usage(compiled) -> dict[str, int]:
    """Registers per thread and bytes of local memory (register spills) of a compiled kernel's cubin."""
    from bench.costmodel.cubins import resource_usage as cubin_resource_usage

    return cubin_resource_usage(compiled.asm["cubin"])
