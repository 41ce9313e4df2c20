"""Imported by every test process (``tests/conftest.py``'s workers, the forked test server of ``tests/forked.py``,
the Triton interpreter's process of ``tests/helpers.py``): Python's collector tuned for processes that compile.

Python's full collections walk every object the process holds, torch's, transformers' and sympy's included
(millions), and a compile makes cyclic garbage fast enough to start one every few seconds. Frozen after the imports
every test needs, those objects are left out of the walk, and the older generations are collected less often
(docs/testing.md has what it saves). A test that needs garbage gone calls ``gc.collect()`` itself.
"""

import gc

import torch  # noqa: F401
import transformers  # noqa: F401

import fp8graph  # noqa: F401

gc.freeze()
gc.set_threshold(10000, 20, 20)
