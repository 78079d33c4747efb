"""Baseline selectors, one file per method; each class here is registered by its `name`."""

from rbs_bench.baselines.flashprefill import FlashPrefill
from rbs_bench.baselines.flexprefill import FlexPrefill
from rbs_bench.baselines.minference import MInference
from rbs_bench.baselines.quest import Quest
from rbs_bench.baselines.xattn import XAttention

SELECTORS: list[type] = [FlashPrefill, XAttention, FlexPrefill, MInference, Quest]
