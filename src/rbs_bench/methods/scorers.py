"""The block scores of the rules the observations compare in their rank-underestimation panel.

Each scorer is one rule's raw block score, before any threshold: the centroid rule (mean-only),
RBS's rescue branch, the full L2 bound, and Quest's box bound. `rbs_bench.observations` ranks each
query block's candidates by them; this module is where the rules' names meet their scores.
"""

from __future__ import annotations

from torch import Tensor

from rbs_bench.kernels.block_scores import block_scores_ref
from rbs_bench.kernels.block_stats import block_stats_ref, rescue_beta_ref
from rbs_bench.kernels.quest_select import box_scores_ref, box_stats_ref

# The scorers in panel order, their legend labels and colours, and those whose bars are labelled.
SCORERS = ("centroid", "rbs", "full_l2", "quest")
SCORER_LABELS = {
    "centroid": "centroid (mean-only)",
    "rbs": "RBS rescue",
    "full_l2": "full L2",
    "quest": "Quest box",
}
SCORER_COLOURS = {"centroid": "#1f77b4", "rbs": "#d62728", "full_l2": "#9467bd", "quest": "#8c564b"}
LABELLED = ("centroid", "rbs")


def scorer_scores(q: Tensor, k: Tensor, block_size: int, scale: float | None):
    """({scorer: fp32 [B, Hq, M, M] block scores}, radius [B, Hkv, M], beta [B, Hkv, M])."""
    centroid, radius = block_stats_ref(k, block_size)
    beta = rescue_beta_ref(radius)
    base, rescue, full = block_scores_ref(
        q, centroid, [None, radius * beta, radius], block_size, scale
    )
    kmin, kmax = box_stats_ref(k, block_size)
    quest = box_scores_ref(q, kmin, kmax, block_size)
    return {"centroid": base, "rbs": rescue, "full_l2": full, "quest": quest}, radius, beta
