"""SnapKV prompt compression and its variants/baselines, as ``accel`` prompt compressors.

Importing the package registers the selectors ``snapkv``, ``ada_snapkv``, ``streaming_llm``
and ``h2o`` (each with ``decode_budget=`` for eviction during decoding), ``fastgen``
(per-head policies, applied to generated tokens too), ``gear``, which quantizes what a
selector keeps, and ``infinigen``, which drops nothing: the cache lives in a slow tier and
each decode step fetches what its queries are predicted to need.
"""

from .ada import AdaSnapKV
from .base import ScoredCompressor
from .fastgen import FastGen
from .gear import GEAR
from .h2o import H2O
from .infinigen import InfiniGen
from .scoring import pool_scores, prefix_scores, reduce_gqa, select_topk, snapkv_indices, window_scores
from .snapkv import SnapKV
from .streaming import StreamingLLM

__all__ = [
    "SnapKV",
    "AdaSnapKV",
    "StreamingLLM",
    "H2O",
    "GEAR",
    "FastGen",
    "InfiniGen",
    "ScoredCompressor",
    "window_scores",
    "pool_scores",
    "reduce_gqa",
    "select_topk",
    "prefix_scores",
    "snapkv_indices",
]
