"""FX graph passes of the fp8 backend, in pipeline order.

``stats_inputs``, ``state_inputs`` -> ``find_sites`` -> ``annotate`` -> ``rewrite``. The annotate pass only writes a
decision into ``node.meta``; the rewrite pass only reads it; the report is
built from the same decisions.
"""

from .annotate import DECISION_KEY, annotate_sites
from .find_sites import Site, find_sites
from .module_paths import module_path
from .rewrite import rewrite_sites
from .state_inputs import take_state_inputs
from .stats_inputs import take_stats_input

__all__ = ["DECISION_KEY", "Site", "annotate_sites", "find_sites", "module_path", "rewrite_sites", "take_state_inputs", "take_stats_input"]
