"""An experiment, not library code: decode attention over a long float32 cache, torch's sdpa
against a plain C++ kernel (each KV head's entries split in chunks over all threads, partial
softmax sums recombined), compiled here with torch.utils.cpp_extension (needs g++; ~50 s).

    python benchmarks/decode_attention_native.py

One query token, 3 KV heads x 3 query heads of 64 dimensions, 7,500 entries; 30 layers' caches
read in turn, so that each comes from memory as in a decode step. Prints the largest difference
from sdpa and microseconds a layer for chunks of 256, 512 and 1024 entries.
"""
import tempfile
import time

import torch
import torch.nn.functional as F
from torch.utils.cpp_extension import load_inline

SRC = r'''
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <vector>
// q [H, G, D], k/v [H, P, D] (row stride sk, head stride hk), out [H, G, D]
torch::Tensor decode_attn(torch::Tensor q, torch::Tensor k, torch::Tensor v, double scale, int64_t chunk) {
  const int64_t H = q.size(0), G = q.size(1), D = q.size(2), P = k.size(1);
  const int64_t nc = (P + chunk - 1) / chunk;
  auto qc = q.contiguous();
  const float* qp = qc.data_ptr<float>();
  const float* kp = k.data_ptr<float>(); const float* vp = v.data_ptr<float>();
  const int64_t khs = k.stride(0), krs = k.stride(1), vhs = v.stride(0), vrs = v.stride(1);
  std::vector<float> M(H*nc*G), L(H*nc*G), A(H*nc*G*D);
  at::parallel_for(0, H*nc, 1, [&](int64_t b, int64_t e) {
    std::vector<float> s(chunk * G);
    for (int64_t t = b; t < e; ++t) {
      int64_t h = t / nc, c = t % nc, lo = c*chunk, hi = std::min(P, lo+chunk), n = hi-lo;
      const float* qh = qp + h*G*D;
      for (int64_t j = 0; j < n; ++j) {
        const float* kr = kp + h*khs + (lo+j)*krs;
        for (int64_t g = 0; g < G; ++g) {
          float acc = 0.f; const float* qq = qh + g*D;
          #pragma omp simd reduction(+:acc)
          for (int64_t d = 0; d < D; ++d) acc += qq[d]*kr[d];
          s[j*G+g] = acc * (float)scale;
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        float m = -INFINITY; for (int64_t j = 0; j < n; ++j) m = std::max(m, s[j*G+g]);
        float l = 0.f; for (int64_t j = 0; j < n; ++j) { float p = std::exp(s[j*G+g]-m); s[j*G+g]=p; l+=p; }
        M[t*G+g]=m; L[t*G+g]=l;
      }
      float* a = A.data() + t*G*D;
      for (int64_t i=0;i<G*D;++i) a[i]=0.f;
      for (int64_t j = 0; j < n; ++j) {
        const float* vr = vp + h*vhs + (lo+j)*vrs;
        for (int64_t g = 0; g < G; ++g) { float p = s[j*G+g]; float* ag = a+g*D;
          #pragma omp simd
          for (int64_t d=0; d<D; ++d) ag[d] += p*vr[d]; }
      }
    }
  });
  auto out = torch::empty({H, G, D}, q.options()); float* op = out.data_ptr<float>();
  for (int64_t h=0; h<H; ++h) for (int64_t g=0; g<G; ++g) {
    float m=-INFINITY; for (int64_t c=0;c<nc;++c) m=std::max(m, M[(h*nc+c)*G+g]);
    float l=0.f; float* o = op+(h*G+g)*D; for (int64_t d=0;d<D;++d) o[d]=0.f;
    for (int64_t c=0;c<nc;++c){ float w=std::exp(M[(h*nc+c)*G+g]-m); l+=w*L[(h*nc+c)*G+g];
      const float* a=A.data()+((h*nc+c)*G+g)*D; for (int64_t d=0;d<D;++d) o[d]+=w*a[d]; }
    for (int64_t d=0;d<D;++d) o[d]/=l;
  }
  return out;
}
'''


def main() -> None:
    t=time.time()
    mod = load_inline("decattn", cpp_sources=SRC, functions=["decode_attn"], extra_cflags=["-O3","-march=native","-fopenmp"], build_directory=tempfile.mkdtemp(prefix="accel-decattn-"), verbose=False)
    print("compile %.1f s" % (time.time()-t))
    P=7500; cap=P+256; Lyr=30; s=64**-0.5
    Ks=[torch.randn(1,3,cap,64) for _ in range(Lyr)]; Vs=[torch.randn(1,3,cap,64) for _ in range(Lyr)]
    q=torch.randn(1,3,3,64); mask=torch.zeros(1,1,1,P)
    sd=lambda K,V: F.scaled_dot_product_attention(q, K[:,:,:P], V[:,:,:P], attn_mask=mask, scale=s)
    for ch in (256, 512, 1024):
        kn=lambda K,V: mod.decode_attn(q[0], K[0,:,:P], V[0,:,:P], s, ch)
        print("diff", (kn(Ks[0],Vs[0])-sd(Ks[0],Vs[0])[0]).abs().max().item())
        for name,f in [("sdpa",sd),(f"native chunk {ch}",kn)]:
            for _ in range(2): [f(Ks[i],Vs[i]) for i in range(Lyr)]
            t0=time.perf_counter()
            for _ in range(5): [f(Ks[i],Vs[i]) for i in range(Lyr)]
            d=(time.perf_counter()-t0)/5/Lyr
            print(f"{name}: {d*1e6:.0f} us a layer = {11.52e6/d/1e9:.1f} GB/s")


if __name__ == "__main__":
    main()
