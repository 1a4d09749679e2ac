"""accel: faster, leaner generation for Hugging Face causal LMs.

SnapKV prompt compression and speculative decoding (Medusa heads, prompt lookup) on one
shared, compressed KV cache that the verifier and every drafter read.
"""

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
    "GenerateResult",
    "Stats",
    "SharedCache",
    "load_model",
    "load_default",
    "prepack",
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


# The engine imports the `speculative` package, whose strategies import `accel.strategy`; the
# heavier modules load on first use so that either package can be imported first.
_LAZY = {
    "generate": "api",
    "GenerateResult": "api",
    "Stats": "engine",
    "SharedCache": "cache",
    "load_model": "models",
    "load_default": "models",
    "prepack": "cpu",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'accel' has no attribute {name!r}")
