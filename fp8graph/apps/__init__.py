"""Programs built on the library: the demo and the distributed trainer (``python -m fp8graph ...``).
"""
