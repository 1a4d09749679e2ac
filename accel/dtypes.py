"""Dtype names: every public call that takes a dtype takes a ``torch.dtype`` or one of these
names (``"bfloat16"`` and ``"bf16"`` alike); a wrong name lists the choices."""

from __future__ import annotations

import argparse
from typing import Annotated, Literal

import torch
from pydantic import BeforeValidator

__all__ = ["DTYPES", "DTYPE_ALIASES", "DtypeName", "dtype_name", "as_dtype", "dtype_arg"]

#: The canonical names and the dtypes they stand for.
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

#: Other spellings accepted for them.
DTYPE_ALIASES: dict[str, str] = {"fp32": "float32", "f32": "float32", "float": "float32",
                                 "bf16": "bfloat16",
                                 "fp16": "float16", "f16": "float16", "half": "float16"}


def dtype_name(value: str | torch.dtype) -> str:
    """The canonical name (``float32``, ``bfloat16``, ``float16``) of a dtype or dtype name.
    Raises ValueError naming the choices for anything else."""
    if isinstance(value, torch.dtype):
        for name, dtype in DTYPES.items():
            if dtype == value:
                return name
        raise ValueError(f"unsupported dtype {value}; choose one of {', '.join(DTYPES)}")
    if isinstance(value, str):
        key = value.strip().lower().removeprefix("torch.")
        key = DTYPE_ALIASES.get(key, key)
        if key in DTYPES:
            return key
    choices = ", ".join(list(DTYPES) + list(DTYPE_ALIASES))
    raise ValueError(f"unknown dtype {value!r}; choose one of {choices} (or a torch.dtype)")


def as_dtype(value: str | torch.dtype) -> torch.dtype:
    """``value`` as a ``torch.dtype`` (see :func:`dtype_name`)."""
    return DTYPES[dtype_name(value)]


def dtype_arg(value: str) -> str:
    """argparse ``type=`` for a ``--dtype`` flag: the canonical name, or a usage error."""
    try:
        return dtype_name(value)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


#: A pydantic field type for a dtype name: aliases are accepted and stored canonical.
DtypeName = Annotated[Literal["float32", "bfloat16", "float16"],
                      BeforeValidator(lambda v: dtype_name(v) if isinstance(v, (str, torch.dtype)) else v)]
