"""accel: faster, leaner generation for Hugging Face causal LMs.

SnapKV prompt compression and speculative decoding (Medusa heads, prompt lookup) on one
shared, compressed KV cache that the verifier and every drafter read.
"""

from .api import GenerateResult, StreamDelta, generate, stream
from .cache import SharedCache
from .kernels.cpu import prepack
from .engine import Stats
from .models import load_default, load_model
from .runahead import PrefillRanks
from .serving.service import Delta, Engine, RequestHandle, RequestResult
from .strategy import (
    REGISTRY,
    AcceptanceRule,
    Drafter,
    PromptCompressor,
    Strategy,
    StrategyError,
    build_strategies,
    build_strategy,
    register,
)

__all__ = [
    "generate",
    "stream",
    "GenerateResult",
    "StreamDelta",
    "Engine",
    "RequestHandle",
    "RequestResult",
    "Delta",
    "Stats",
    "SharedCache",
    "load_model",
    "load_default",
    "prepack",
    "PrefillRanks",
    "Strategy",
    "PromptCompressor",
    "Drafter",
    "AcceptanceRule",
    "StrategyError",
    "REGISTRY",
    "register",
    "build_strategy",
    "build_strategies",
]

__version__ = "0.1.0"
