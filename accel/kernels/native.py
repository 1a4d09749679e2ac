"""Small C++ kernels compiled on first use with torch's extension builder (g++ and ninja),
kept per machine under the accel cache folder (``$ACCEL_CACHE/kernels``).

:func:`gear_decode` writes GEAR's packed groups back as float32 entries in one pass (codes
unpacked, scaled, the low-rank term added, outliers put back): plain torch needs five
passes over the entries and a temporary, which made a step over a packed cache much slower
than one over full-precision entries. Where no compiler is at hand (or it fails) the caller
keeps its torch path; :func:`gear_kernel` says which, and warns once why.
``ACCEL_NATIVE_KERNELS=0`` keeps the torch path everywhere.
"""

from __future__ import annotations

import hashlib
import os
import sys
import threading

import torch

__all__ = ["gear_kernel", "gear_decode"]

_SRC = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>

// One group per (row, head, group) index n of N = B * H * g: codes [N, G, D * bits / 8]
// uint8, scale / zero [N, S] (S = D per channel, G per token), a [N, G, r] and b [N, r, D]
// (r may be 0), all of one 16-bit type M; idx [N, k] int16 or int32 flat positions in
// [G, D] and val [N, k] float32. out: float32 [B, H, g, G, D], last two dims contiguous.
// counts [B] (or empty): the groups each row holds; groups past them are not written.
template <typename M, typename Ix, int BITS>
static void decode(const uint8_t* C, const M* SC, const M* Z, const M* A, const M* Bf, const Ix* I, const float* V,
                   int64_t r, int64_t k, int64_t S, bool per_channel, torch::Tensor out, const int64_t* counts) {
  const int64_t H = out.size(1), g = out.size(2), G = out.size(3), D = out.size(4);
  const int64_t sb = out.stride(0), sh = out.stride(1), sg = out.stride(2);
  constexpr int per = 8 / BITS, mask = (1 << BITS) - 1;
  const int64_t dp = D / per;
  float* O = out.data_ptr<float>();
  at::parallel_for(0, out.size(0) * H * g, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> s(D), z(D), bq(r * D);
    for (int64_t n = begin; n < end; ++n) {
      if (counts && n % g >= counts[n / (H * g)]) continue;  // past the row's groups: left as it was
      float* o = O + (n / (H * g)) * sb + ((n / g) % H) * sh + (n % g) * sg;
      const uint8_t* c = C + n * G * dp;
      for (int64_t d = 0; d < r * D; ++d) bq[d] = (float)Bf[n * r * D + d];
      if (per_channel)
        for (int64_t d = 0; d < D; ++d) { s[d] = (float)SC[n * S + d]; z[d] = (float)Z[n * S + d]; }
      for (int64_t t = 0; t < G; ++t) {
        const uint8_t* ct = c + t * dp;
        float* ot = o + t * D;
        if (per_channel) {
          for (int64_t j = 0; j < dp; ++j)
            for (int i = 0; i < per; ++i)
              ot[j * per + i] = (float)((ct[j] >> (BITS * i)) & mask) * s[j * per + i] + z[j * per + i];
        } else {
          const float st = (float)SC[n * S + t], zt = (float)Z[n * S + t];
          for (int64_t j = 0; j < dp; ++j)
            for (int i = 0; i < per; ++i) ot[j * per + i] = (float)((ct[j] >> (BITS * i)) & mask) * st + zt;
        }
        for (int64_t q = 0; q < r; ++q) {
          const float at = (float)A[(n * G + t) * r + q];
          const float* b = bq.data() + q * D;
          for (int64_t d = 0; d < D; ++d) ot[d] += at * b[d];
        }
      }
      for (int64_t q = 0; q < k; ++q) o[(int64_t)I[n * k + q]] = V[n * k + q];
    }
  });
}

template <typename M, typename Ix>
static void dispatch_bits(torch::Tensor codes, torch::Tensor scale, torch::Tensor zero, torch::Tensor a,
                          torch::Tensor b, torch::Tensor idx, torch::Tensor val, int64_t bits, bool per_channel,
                          torch::Tensor out, const int64_t* counts) {
  const int64_t r = a.numel() ? a.size(2) : 0, k = idx.numel() ? idx.size(1) : 0;
  const M* A = r ? (const M*)a.data_ptr() : nullptr;
  const M* Bf = r ? (const M*)b.data_ptr() : nullptr;
  const Ix* I = k ? (const Ix*)idx.data_ptr() : nullptr;
  const float* V = k ? val.data_ptr<float>() : nullptr;
  auto f = bits == 4 ? decode<M, Ix, 4> : decode<M, Ix, 2>;
  f(codes.data_ptr<uint8_t>(), (const M*)scale.data_ptr(), (const M*)zero.data_ptr(), A, Bf, I, V, r, k,
    scale.size(1), per_channel, out, counts);
}

void gear_decode(torch::Tensor codes, torch::Tensor scale, torch::Tensor zero, torch::Tensor a, torch::Tensor b,
                 torch::Tensor idx, torch::Tensor val, int64_t bits, bool per_channel, torch::Tensor out,
                 torch::Tensor counts) {
  // the parts come as [B, H, g, ...]: flat over (row, head, group), contiguous
  const int64_t n = out.size(0) * out.size(1) * out.size(2), G = out.size(3), D = out.size(4);
  codes = codes.reshape({n, G, -1}).contiguous();
  scale = scale.reshape({n, -1}).contiguous();
  zero = zero.reshape({n, -1}).contiguous();
  if (a.numel()) { a = a.reshape({n, G, -1}).contiguous(); b = b.reshape({n, -1, D}).contiguous(); }
  if (idx.numel()) { idx = idx.reshape({n, -1}).contiguous(); val = val.reshape({n, -1}).to(torch::kFloat).contiguous(); }
  counts = counts.to(torch::kLong).contiguous();
  const int64_t* cnt = counts.numel() ? counts.data_ptr<int64_t>() : nullptr;
  const bool wide = idx.scalar_type() == torch::kInt32;
  if (scale.scalar_type() == torch::kBFloat16) {
    if (wide) dispatch_bits<at::BFloat16, int32_t>(codes, scale, zero, a, b, idx, val, bits, per_channel, out, cnt);
    else dispatch_bits<at::BFloat16, int16_t>(codes, scale, zero, a, b, idx, val, bits, per_channel, out, cnt);
  } else {
    if (wide) dispatch_bits<at::Half, int32_t>(codes, scale, zero, a, b, idx, val, bits, per_channel, out, cnt);
    else dispatch_bits<at::Half, int16_t>(codes, scale, zero, a, b, idx, val, bits, per_channel, out, cnt);
  }
}
"""

_lock = threading.Lock()
_module = None
_failure: str | None = None


def gear_kernel():
    """The compiled module, or None (no compiler, or it failed: warned once on stderr)."""
    global _module, _failure
    if os.environ.get("ACCEL_NATIVE_KERNELS") == "0":
        return None
    if _module is not None or _failure is not None:
        return _module
    with _lock:
        if _module is not None or _failure is not None:
            return _module
        try:
            from torch.utils.cpp_extension import load_inline

            from ..calibration.calibrate import _machine
            from ..files import cache_dir

            # -march=native: a build is this CPU's (a cache folder shared with another CPU builds its own)
            digest = hashlib.sha256((_SRC + repr(sorted(_machine().items()))).encode()).hexdigest()[:12]
            folder = cache_dir() / "kernels" / f"gear-{digest}"
            folder.mkdir(parents=True, exist_ok=True)
            if not (folder / "accel_gear.so").exists():
                print("accel: compiling the GEAR decode kernel (once per machine, about a minute)...",
                      file=sys.stderr, flush=True)
            _module = load_inline("accel_gear", cpp_sources=_SRC, functions=["gear_decode"],
                                  extra_cflags=["-O3", "-march=native", "-fopenmp"],
                                  extra_ldflags=["-fopenmp"], build_directory=str(folder), verbose=False)
        except Exception as err:  # no compiler, no ninja, a failed build: torch ops instead
            _failure = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
            print(f"accel: the GEAR decode kernel is not available ({_failure}); decoding with torch ops",
                  file=sys.stderr, flush=True)
    return _module


def gear_decode(parts: dict[str, torch.Tensor], bits: int, per_channel: bool, out: torch.Tensor,
                groups: list[int] | None = None) -> bool:
    """Decode GEAR groups ``parts`` (codes [B, H, g, G, D*bits/8], scale, zero, a, b, idx,
    val as :func:`snapkv.gear.encode_group` makes them) into ``out`` [B, H, g, G, D] float32
    on the CPU; with ``groups`` (per row of out) only each row's first ``groups[b]`` groups.
    Returns False (nothing written) where the kernel cannot serve it."""
    if out.dim() != 5 or out.dtype != torch.float32 or out.device.type != "cpu" or out.stride(-1) != 1 \
            or out.stride(-2) != out.shape[-1]:
        return False
    mod = gear_kernel()
    if mod is None:
        return False
    meta = parts["scale"].dtype
    if meta not in (torch.float16, torch.bfloat16):
        return False
    none = _EMPTY.get(meta)
    if none is None:
        none = _EMPTY[meta] = (torch.empty(0, dtype=meta), torch.empty(0, dtype=torch.int16), torch.empty(0))
    mod.gear_decode(parts["codes"], parts["scale"], parts["zero"], parts.get("a", none[0]), parts.get("b", none[0]),
                    parts.get("idx", none[1]), parts.get("val", none[2]), bits, per_channel, out,
                    torch.tensor(groups if groups is not None else [], dtype=torch.int64))
    return True


_EMPTY: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
