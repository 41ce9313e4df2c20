"""Imported by the forked test server (``tests/forked.py``'s ``PRELOAD``): Inductor's probe of the CPU's vector
instructions, run once there, so that every child forked from it inherits the answer.

The probe compiles and runs a test program for each instruction set Inductor knows (about 1.4 s on the 2-core CI
machine), once per process that compiles a C++ kernel; each fork of the server would otherwise run it again.
Under tests/conftest.py's ``TORCHINDUCTOR_VEC_ISA_OK=0`` (scalar C++ kernels) it answers at once: kept for runs
that set it otherwise.
"""

from torch._inductor.cpu_vec_isa import pick_vec_isa

pick_vec_isa()
