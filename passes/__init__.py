"""FX graph passes of the fp8 backend: ``pipeline.PASSES`` is their ordered list, ``pipeline.run_passes`` the
driver that runs them and checks the graph's side effects after each (``python -m fp8graph passes`` prints
the list). The annotate pass only writes a decision into ``node.meta``; ``group_sites`` groups the decided
sites that read one input; the rewrite pass only reads decisions and groups; the report is built from the
same decisions.
"""

from .annotate import DECISION_KEY, annotate_sites
from .find_sites import find_sites
from .group_sites import group_sites
from .module_paths import module_path
from .rewrite import rewrite_sites
from .anchored_inputs import take_anchored_inputs
from .sites import ExpertSite, FusedCallSite, GatheredExpertSite, GroupedExpertSite, LinearSite, MatmulSite, Site

__all__ = ["DECISION_KEY", "ExpertSite", "FusedCallSite", "GatheredExpertSite", "GroupedExpertSite", "LinearSite",
           "MatmulSite", "Site", "annotate_sites", "find_sites", "group_sites", "module_path", "rewrite_sites",
           "take_anchored_inputs"]
