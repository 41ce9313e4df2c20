"""The tests' forked children (``tests/forked.py``) start from a server that imported all of ``PRELOAD``."""

import gc
import json
import os

import forked


def test_a_forked_child_has_every_preloaded_module_and_the_workers_collector():
    """The server imported the tests' own preloads too (Python 3.11's forkserver does not take the parent's path,
    and skips a module it cannot import silently), so its children collect garbage as the test workers do."""
    code = ("import gc, json, sys; print(json.dumps([[name for name in sys.argv[1:] if name not in sys.modules], "
            "gc.get_threshold(), gc.get_freeze_count() > 0]))")
    completed = forked.run_python(["-c", code, *forked.PRELOAD], cwd=os.getcwd(), timeout=120, check=True)
    missing, threshold, frozen = json.loads(completed.stdout.splitlines()[-1])
    assert missing == [] and frozen, completed.stdout
    assert tuple(threshold) == gc.get_threshold()
