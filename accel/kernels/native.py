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

__all__ = ["gear_decode", "gear_kernel", "ordered_attend", "ordered_kernel"]

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

_ORDERED_SRC = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <limits>
#include <vector>

// Ordered attention (accel.kernels.ordered): query t of row b, query head hq = h * G + g,
// attends to the keys at storage columns cols[b, t, 0 .. counts[b, t] - 1] (its virtual
// columns, in logical order) under the additive mask[b, hq or 0, t, column]. The virtual
// columns are cut into blocks of 64; per block: scores (a dot product over D in 8 lanes,
// summed in a fixed tree), the block's max, exp(s - max), the weights' sum and the weighted
// values summed key by key; blocks merged in order into one running (max, sum, values).
// Every operation's order is fixed by the query's own virtual columns: a query gets the same
// bits whatever the other rows, queries and heads of the call.
constexpr int64_t BLOCK = 64;

template <typename E, typename M>
static void run(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& mask,
                const torch::Tensor& cols, const torch::Tensor& counts, double scale, torch::Tensor& out) {
  const int64_t B = q.size(0), Hq = q.size(1), T = q.size(2), D = q.size(3);
  const int64_t Hkv = k.size(1), G = Hq / Hkv, W = cols.size(2);
  const bool per_head = mask.size(1) != 1;
  const E* Q = q.data_ptr<E>();
  const E* K = k.data_ptr<E>();
  const E* V = v.data_ptr<E>();
  const M* Mk = mask.data_ptr<M>();
  const int64_t* C = cols.data_ptr<int64_t>();
  const int64_t* N = counts.data_ptr<int64_t>();
  E* O = out.data_ptr<E>();
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), qs2 = q.stride(2), qs3 = q.stride(3);
  const int64_t ks0 = k.stride(0), ks1 = k.stride(1), ks2 = k.stride(2);
  const int64_t vs0 = v.stride(0), vs1 = v.stride(1), vs2 = v.stride(2);
  const int64_t ms0 = mask.stride(0), ms1 = mask.stride(1), ms2 = mask.stride(2), ms3 = mask.stride(3);
  const int64_t os0 = out.stride(0), os1 = out.stride(1), os2 = out.stride(2);
  const float sc = (float)scale, ninf = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, B * Hkv * T, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), kd(D), vd(D), s(G * BLOCK), acc(G * D), blk(G * D), top(G), sum(G);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / (Hkv * T), h = (task / T) % Hkv, t = task % T;
      const int64_t* col = C + (b * T + t) * W;
      const int64_t n = N[b * T + t];
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d) qf[g * D + d] = (float)Q[b * qs0 + (h * G + g) * qs1 + t * qs2 + d * qs3];
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(top.begin(), top.end(), ninf);
      std::fill(sum.begin(), sum.end(), 0.f);
      for (int64_t start = 0; start < n; start += BLOCK) {
        const int64_t len = std::min(BLOCK, n - start);
        for (int64_t i = 0; i < len; ++i) {
          const int64_t c = col[start + i];
          const E* kr = K + b * ks0 + h * ks1 + c * ks2;
          for (int64_t d = 0; d < D; ++d) kd[d] = (float)kr[d];
          for (int64_t g = 0; g < G; ++g) {
            const float* qg = qf.data() + g * D;
            float p[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
            for (int64_t d = 0; d < D; d += 8)
              for (int l = 0; l < 8; ++l) p[l] += qg[d + l] * kd[d + l];
            const float dot = ((p[0] + p[1]) + (p[2] + p[3])) + ((p[4] + p[5]) + (p[6] + p[7]));
            const int64_t hm = per_head ? h * G + g : 0;
            s[g * BLOCK + i] = dot * sc + (float)Mk[b * ms0 + hm * ms1 + t * ms2 + c * ms3];
          }
        }
        std::fill(blk.begin(), blk.end(), 0.f);
        float m[64], l[64];  // per query head (G <= 64)
        for (int64_t g = 0; g < G; ++g) {
          float mx = ninf;
          for (int64_t i = 0; i < len; ++i) mx = std::max(mx, s[g * BLOCK + i]);
          float total = 0.f;
          for (int64_t i = 0; i < len; ++i) {
            const float e = mx == ninf ? 0.f : std::exp(s[g * BLOCK + i] - mx);
            s[g * BLOCK + i] = e;
            total += e;
          }
          m[g] = mx;
          l[g] = total;
        }
        for (int64_t i = 0; i < len; ++i) {
          const E* vr = V + b * vs0 + h * vs1 + col[start + i] * vs2;
          for (int64_t d = 0; d < D; ++d) vd[d] = (float)vr[d];
          for (int64_t g = 0; g < G; ++g) {
            const float e = s[g * BLOCK + i];
            float* o = blk.data() + g * D;
            for (int64_t d = 0; d < D; ++d) o[d] += e * vd[d];
          }
        }
        for (int64_t g = 0; g < G; ++g) {  // merge the block into the running (max, sum, values)
          if (m[g] == ninf) continue;
          float* a = acc.data() + g * D;
          const float* o = blk.data() + g * D;
          if (m[g] > top[g]) {
            const float r = top[g] == ninf ? 0.f : std::exp(top[g] - m[g]);
            for (int64_t d = 0; d < D; ++d) a[d] = a[d] * r + o[d];
            sum[g] = sum[g] * r + l[g];
            top[g] = m[g];
          } else {
            const float r = std::exp(m[g] - top[g]);
            for (int64_t d = 0; d < D; ++d) a[d] += o[d] * r;
            sum[g] += l[g] * r;
          }
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        E* o = O + b * os0 + t * os1 + (h * G + g) * os2;
        const float inv = sum[g] > 0.f ? 1.f / sum[g] : 0.f;
        for (int64_t d = 0; d < D; ++d) o[d] = (E)(acc[g * D + d] * inv);
      }
    }
  });
}

template <typename E>
static void with_mask(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& mask,
                      const torch::Tensor& cols, const torch::Tensor& counts, double scale, torch::Tensor& out) {
  if (mask.scalar_type() == torch::kFloat) run<E, float>(q, k, v, mask, cols, counts, scale, out);
  else if (mask.scalar_type() == torch::kBFloat16) run<E, at::BFloat16>(q, k, v, mask, cols, counts, scale, out);
  else run<E, at::Half>(q, k, v, mask, cols, counts, scale, out);
}

// q [B, H_q, T, D]; k, v [B, H_kv, S, D] (last dim contiguous); mask [B, 1 or H_q, T, S']
// additive; cols [B, T, W] int64 storage columns; counts [B, T] int64; out [B, T, H_q, D]
// of q's type (last dim contiguous), written.
void ordered_attend(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor mask, torch::Tensor cols,
                    torch::Tensor counts, double scale, torch::Tensor out) {
  TORCH_CHECK(q.size(3) % 8 == 0 && q.size(1) % k.size(1) == 0 && q.size(1) / k.size(1) <= 64, "ordered_attend: shapes");
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1 && out.stride(3) == 1, "ordered_attend: last dims contiguous");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type() && out.scalar_type() == q.scalar_type(),
              "ordered_attend: one dtype");
  cols = cols.contiguous();
  counts = counts.contiguous();
  if (q.scalar_type() == torch::kBFloat16) with_mask<at::BFloat16>(q, k, v, mask, cols, counts, scale, out);
  else if (q.scalar_type() == torch::kHalf) with_mask<at::Half>(q, k, v, mask, cols, counts, scale, out);
  else with_mask<float>(q, k, v, mask, cols, counts, scale, out);
}
"""


_lock = threading.Lock()
_modules: dict[str, object] = {}  # kernel name -> compiled module
_failures: dict[str, str] = {}  # kernel name -> why it is not available


def _cpu() -> str:
    """This CPU's model name and flags (what ``-march=native`` compiles for)."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [line for line in f if line.startswith(("model name", "flags"))][:2]
    except OSError:
        lines = []
    import platform

    return platform.machine() + platform.processor() + "".join(lines)


def _load(name: str, src: str, functions: list[str], what: str):
    """The compiled module ``accel_<name>`` of ``src`` (built once per machine and source under
    ``$ACCEL_CACHE/kernels``), or None: ``ACCEL_NATIVE_KERNELS=0``, no compiler, or a failed
    build (warned once on stderr, naming ``what`` the caller does instead)."""
    if os.environ.get("ACCEL_NATIVE_KERNELS") == "0":
        return None
    if name in _modules or name in _failures:
        return _modules.get(name)
    with _lock:
        if name in _modules or name in _failures:
            return _modules.get(name)
        try:
            from torch.utils.cpp_extension import load_inline

            from ..files import cache_dir

            # -march=native: a build is this CPU's (a cache folder shared with another CPU builds its own)
            digest = hashlib.sha256((src + _cpu()).encode()).hexdigest()[:12]
            folder = cache_dir() / "kernels" / f"{name}-{digest}"
            folder.mkdir(parents=True, exist_ok=True)
            if not (folder / f"accel_{name}.so").exists():
                print(f"accel: compiling the {name} kernel (once per machine, about a minute)...",
                      file=sys.stderr, flush=True)
            _modules[name] = load_inline(f"accel_{name}", cpp_sources=src, functions=functions,
                                         extra_cflags=["-O3", "-march=native", "-fopenmp"],
                                         extra_ldflags=["-fopenmp"], build_directory=str(folder), verbose=False)
        except Exception as err:  # no compiler, no ninja, a failed build: torch ops instead
            _failures[name] = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
            print(f"accel: the {name} kernel is not available ({_failures[name]}); {what}",
                  file=sys.stderr, flush=True)
    return _modules.get(name)


def gear_kernel():
    """The compiled GEAR decode module, or None (no compiler, or it failed: warned once on stderr)."""
    return _load("gear", _SRC, ["gear_decode"], "decoding with torch ops")


def ordered_kernel():
    """The compiled ordered attention module, or None (warned once on stderr)."""
    return _load("ordered", _ORDERED_SRC, ["ordered_attend"], "ordered attention runs torch ops")


_ORDERED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def ordered_serves(dtype: torch.dtype, head_dim: int, groups: int, device) -> bool:
    """Whether :func:`ordered_attend` serves attention of this dtype and head geometry on
    ``device`` (the kernel built, or buildable: the first call builds it)."""
    return (torch.device(device).type == "cpu" and dtype in _ORDERED_DTYPES and head_dim % 8 == 0
            and 0 < groups <= 64 and ordered_kernel() is not None)


def ordered_attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                   cols: torch.Tensor, counts: torch.Tensor, scale: float) -> torch.Tensor | None:
    """Ordered attention in one pass (:mod:`accel.kernels.ordered`): query [B, H_q, T, D]
    attends, per row and token, to key and value [B, H_kv, S, D] at the storage columns
    cols[b, t, :counts[b, t]] (int64 [B, T, W] and [B, T]) in that order, under the additive
    mask [B, 1 or H_q, T, S']. Returns [B, T, H_q, D] of query's dtype, or None where the
    kernel cannot serve it (no compiler, not the CPU, D not a multiple of 8, more than 64 query
    heads per KV head, a dtype other than float32 / bfloat16 / float16)."""
    b, hq, t, d = query.shape
    hkv = key.shape[1]
    if hq % hkv or not ordered_serves(query.dtype, d, hq // hkv, query.device) or key.dtype != query.dtype \
            or value.dtype != query.dtype or mask.dtype not in _ORDERED_DTYPES:
        return None
    key = key if key.stride(-1) == 1 else key.contiguous()
    value = value if value.stride(-1) == 1 else value.contiguous()
    mod = ordered_kernel()
    out = torch.empty((b, t, hq, d), dtype=query.dtype)
    mod.ordered_attend(query, key, value, mask, cols, counts, float(scale), out)
    return out


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
