// Attention over a KV cache for XLA:CPU (decode steps and prefill chunks), read in place (built
// and called by cpu.py).
//
// For each row b, kv head k and query r (the G query heads x L chunk positions sharing that kv
// head), over the row's valid slots s < length[b] of layer `layer`:
//   score[s] = scale * q[b,k,r,:] . K[layer,b,k,:,s]
//   m = max_s score,  den = sum_s exp(score - m),  acc = sum_s exp(score - m) V[layer,b,k,s,:]
// The caller merges (m, den, acc) with the chunk's own scores (an online-softmax merge). A row
// with no valid slot gets m = -1e30, den = 0, acc = 0. The write variant first writes the chunk's
// L keys and values into slots [length[b], length[b] + L), then reads causally: query r (chunk
// position r % L) sees slots [0, length[b] + r % L + 1), so its results are the whole attention
// and nothing is left to merge.
//
// XLA:CPU runs the same maths as a loop of 128-slot blocks, each a dynamic-slice copy and two
// tiny batched products; here each (b, k) pair streams its keys and values once, straight from
// the cache, a 64-slot tile at a time through register-tiled products (TiledPair; head sizes
// 32, 64, 128, any other through a plain loop, Pair), and the pairs are shared out over XLA's
// intra-op thread pool.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr float kNeg = -1e30f;

// exp(x) = 2^n * p(r) with x = n ln2 + r, |r| <= ln2/2 (n = x / ln2 rounded) and p a degree-6
// polynomial (relative error ~2e-7, about std::exp's float rounding): p(r) for a float or for a
// vector of floats alike.
template <typename T>
inline T ExpPoly(T x, T n) {
  const T r = (x - n * 0.693145751953125f) - n * 1.428606765330187045e-06f;
  T p = T{} + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  return p * r + 1.0f;
}

// exp(x) for x <= 0 (the softmax's shifted scores), written so that the compiler vectorises the
// loops that call it. Below -87 it returns 0.
inline float ExpNonPositive(float x) {
  x = std::max(x, -87.0f);
  const float n = __builtin_roundevenf(x * 1.44269504088896341f);
  const float p = ExpPoly(x, n);
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  __builtin_memcpy(&scale, &bits, sizeof(scale));
  return x <= -87.0f ? 0.0f : p * scale;
}

struct Shape {
  int64_t layers, b, kh, r, hd, s;
};

// The softmax over each query's n scores in sc [r, n]: leaves exp(score - max) in sc and writes
// the max and the sum.
void Softmax(float* sc, int64_t r, int64_t n, float* m_out, float* den_out) {
  for (int64_t i = 0; i < r; ++i) {
    float* row = sc + i * n;
    float mx = kNeg;
    for (int64_t j = 0; j < n; ++j) mx = std::max(mx, row[j]);
    float sum = 0.0f;
    for (int64_t j = 0; j < n; ++j) {
      row[j] = ExpNonPositive(row[j] - mx);
      sum += row[j];
    }
    m_out[i] = mx;
    den_out[i] = sum;
  }
}

constexpr int64_t kTile = 32;   // slots per score tile of the generic path

// Slots query i sees: the first n, or with a causal chunk of lc > 0 queries (query i at chunk
// position i % lc, its own slot at n + i % lc) the first n + i % lc + 1; never past s.
inline int64_t Seen(int64_t n, int64_t i, int64_t lc, int64_t s) {
  return lc > 0 ? std::min(n + i % lc + 1, s) : n;
}

// One (b, k) pair, any head size (the generic path): r queries q [r, hd], keys [hd, s] (slots
// contiguous), values [s, hd]; query i sees Seen(n, i, lc, s) slots.
void Pair(const float* q, const float* keys, const float* vals, int64_t n, int64_t r, int64_t hd,
          int64_t s, float scale, float* m_out, float* den_out, float* acc_out,
          std::vector<float>& buf, int64_t lc) {
  const int64_t before = n;
  n = lc > 0 ? std::min(n + lc, s) : n;       // the slots any query sees
  if (n <= 0) {
    std::fill(m_out, m_out + r, kNeg);
    std::fill(den_out, den_out + r, 0.0f);
    std::fill(acc_out, acc_out + r * hd, 0.0f);
    return;
  }
  buf.resize(r * n + r * hd);
  float* sc = buf.data();
  float* qs = sc + r * n;
  for (int64_t i = 0; i < r * hd; ++i) qs[i] = q[i] * scale;
  // Scores, a tile of slots at a time: the tile's keys stay in L1 while every query reads them.
  const int64_t full = n / kTile * kTile;
  for (int64_t j0 = 0; j0 < full; j0 += kTile) {
    for (int64_t i = 0; i < r; ++i) {
      float t[kTile] = {};
      const float* qi = qs + i * hd;
      for (int64_t d = 0; d < hd; ++d) {
        const float qd = qi[d];
        const float* kr = keys + d * s + j0;
#pragma GCC unroll 32
        for (int64_t jj = 0; jj < kTile; ++jj) t[jj] += qd * kr[jj];
      }
      std::copy(t, t + kTile, sc + i * n + j0);
    }
  }
  for (int64_t i = 0; i < r; ++i) {
    for (int64_t j = full; j < n; ++j) {
      float t = 0.0f;
      for (int64_t d = 0; d < hd; ++d) t += qs[i * hd + d] * keys[d * s + j];
      sc[i * n + j] = t;
    }
  }
  for (int64_t i = 0; lc > 0 && i < r; ++i) {
    std::fill(sc + i * n + Seen(before, i, lc, s), sc + (i + 1) * n, kNeg);
  }
  Softmax(sc, r, n, m_out, den_out);
  for (int64_t i = 0; i < r; ++i) {
    float* acc = acc_out + i * hd;
    std::fill(acc, acc + hd, 0.0f);
    const float* p = sc + i * n;
    for (int64_t j = 0; j < n; ++j) {
      const float* vr = vals + j * hd;
      for (int64_t d = 0; d < hd; ++d) acc[d] += p[j] * vr[d];
    }
  }
}

// The tiled path (head sizes 32, 64, 128): per tile of kTileC slots, the scores of RB queries
// stay in registers over the head dimension (a small matrix product), then an online softmax per
// query, then the values' product with RB2 queries' accumulators in registers over the tile.
// Two builds of the register blocks, chosen by what -march=native gives: with AVX-512, GCC's
// generic 16-float vectors (one zmm register each, 32 of them); without (AVX2 + FMA hosts such as
// AMD Zen 3), 8-float vectors (one ymm register each, 16 of them) in blocks that fit 16, where
// the 16-float blocks spilled (8.1 against 0.72 ms for a 64-row decode layer at head size 32).
#if defined(__AVX512F__)
typedef float V16 __attribute__((vector_size(64)));
typedef float V16u __attribute__((vector_size(64), aligned(4), may_alias));   // unaligned access
typedef int32_t I16 __attribute__((vector_size(64)));

inline V16 Load(const float* p) { return *reinterpret_cast<const V16u*>(p); }
inline void Store(float* p, V16 v) { *reinterpret_cast<V16u*>(p) = v; }
inline V16 Splat(float x) { return V16{} + x; }

// ExpNonPositive on 16 lanes.
inline V16 ExpV(V16 x) {
  const V16 lo = Splat(-87.0f);
  const V16 xc = x < lo ? lo : x;
  const V16 magic = Splat(12582912.0f);      // 1.5 * 2^23: adding it rounds to an integer
  const V16 n = (xc * 1.44269504088896341f + magic) - magic;
  const V16 p = ExpPoly(xc, n);
  const I16 bits = (__builtin_convertvector(n, I16) + 127) << 23;
  const V16 e = p * reinterpret_cast<const V16&>(bits);
  return x <= lo ? Splat(0.0f) : e;
}

// The largest of 16 lanes: a tree of 4 lane shuffles where the compiler has them (GCC 12+,
// clang), not a chain of 15 dependent scalar maxima once per query and tile.
inline float HMax(V16 v) {
#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12)
  V16 t = __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  v = v > t ? v : t;
  t = __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  v = v > t ? v : t;
  t = __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  v = v > t ? v : t;
  t = __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  v = v > t ? v : t;
  return v[0];
#else
  float m = v[0];
  for (int i = 1; i < 16; ++i) m = std::max(m, v[i]);
  return m;
#endif
}
inline float HSum(V16 v) {
  float s = 0.0f;
  for (int i = 0; i < 16; ++i) s += v[i];
  return s;
}

typedef V16 Vec;
constexpr int64_t kLanes = 16;              // floats per vector
constexpr int64_t kTileC = 64;              // slots per tile
constexpr int64_t kNV = kTileC / 16;        // vectors per query's tile of scores

// sc[i, :] = qs[i, :] . kt[:, 0:kTileC] for queries [i0, r), RB at a time (then RB/2, ...);
// kt's rows are ldk floats apart.
template <int64_t HD, int64_t RB>
void Scores(const float* qs, const float* kt, int64_t ldk, float* sc, int64_t i0, int64_t r) {
  for (; i0 + RB <= r; i0 += RB) {
    const float* qb = qs + i0 * HD;
    V16 a[RB][kNV];
    for (int64_t i = 0; i < RB; ++i) {
      for (int64_t v = 0; v < kNV; ++v) a[i][v] = Splat(0.0f);
    }
    for (int64_t d = 0; d < HD; ++d) {
      V16 kv[kNV];
#pragma GCC unroll 4
      for (int64_t v = 0; v < kNV; ++v) kv[v] = Load(kt + d * ldk + 16 * v);
#pragma GCC unroll 8
      for (int64_t i = 0; i < RB; ++i) {
        const float qd = qb[i * HD + d];
#pragma GCC unroll 4
        for (int64_t v = 0; v < kNV; ++v) a[i][v] += qd * kv[v];
      }
    }
    for (int64_t i = 0; i < RB; ++i) {
      for (int64_t v = 0; v < kNV; ++v) Store(sc + (i0 + i) * kTileC + 16 * v, a[i][v]);
    }
  }
  if constexpr (RB > 1) Scores<HD, RB / 2>(qs, kt, ldk, sc, i0, r);
}

// acc[i, :] += sum_j p[i, j] vals[j, :] over the tile's tn slots, for queries [i0, r), RB at a
// time (then RB/2, ...).
template <int64_t HD, int64_t RB>
void Values(const float* p, const float* vals, int64_t tn, float* acc, int64_t i0, int64_t r) {
  constexpr int64_t HV = HD / 16;
  for (; i0 + RB <= r; i0 += RB) {
    V16 a[RB][HV];
    for (int64_t i = 0; i < RB; ++i) {
      for (int64_t h = 0; h < HV; ++h) a[i][h] = Load(acc + (i0 + i) * HD + 16 * h);
    }
    for (int64_t j = 0; j < tn; ++j) {
      V16 vv[HV];
#pragma GCC unroll 8
      for (int64_t h = 0; h < HV; ++h) vv[h] = Load(vals + j * HD + 16 * h);
#pragma GCC unroll 8
      for (int64_t i = 0; i < RB; ++i) {
        const float pij = p[(i0 + i) * kTileC + j];
#pragma GCC unroll 8
        for (int64_t h = 0; h < HV; ++h) a[i][h] += pij * vv[h];
      }
    }
    for (int64_t i = 0; i < RB; ++i) {
      for (int64_t h = 0; h < HV; ++h) Store(acc + (i0 + i) * HD + 16 * h, a[i][h]);
    }
  }
  if constexpr (RB > 1) Values<HD, RB / 2>(p, vals, tn, acc, i0, r);
}

#else   // no AVX-512: 8-float vectors, register blocks of at most 8 accumulators (16 registers)
typedef float V8 __attribute__((vector_size(32)));
typedef float V8u __attribute__((vector_size(32), aligned(4), may_alias));   // unaligned access
typedef int32_t I8 __attribute__((vector_size(32)));

inline V8 Load(const float* p) { return *reinterpret_cast<const V8u*>(p); }
inline void Store(float* p, V8 v) { *reinterpret_cast<V8u*>(p) = v; }
inline V8 Splat(float x) { return V8{} + x; }
// Load into a register that the compiler keeps (an empty asm that "changes" it): reused vectors
// stay loaded once instead of being folded into every product as a memory operand.
inline V8 LoadReg(const float* p) {
  V8 v = Load(p);
#if defined(__x86_64__) || defined(__i386__)
  asm("" : "+x"(v));                          // "x": an SSE/AVX register
#endif
  return v;
}

// ExpNonPositive on 8 lanes.
inline V8 ExpV(V8 x) {
  const V8 lo = Splat(-87.0f);
  const V8 xc = x < lo ? lo : x;
  const V8 magic = Splat(12582912.0f);       // 1.5 * 2^23: adding it rounds to an integer
  const V8 n = (xc * 1.44269504088896341f + magic) - magic;
  const V8 p = ExpPoly(xc, n);
  const I8 bits = (__builtin_convertvector(n, I8) + 127) << 23;
  const V8 e = p * (V8)bits;                  // the bits reinterpreted: 2^n
  return x <= lo ? Splat(0.0f) : e;
}

// The largest of 8 lanes (a tree of 3 lane shuffles where the compiler has them).
inline float HMax(V8 v) {
#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12)
  V8 t = __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3);
  v = v > t ? v : t;
  t = __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5);
  v = v > t ? v : t;
  t = __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6);
  v = v > t ? v : t;
  return v[0];
#else
  float m = v[0];
  for (int i = 1; i < 8; ++i) m = std::max(m, v[i]);
  return m;
#endif
}
inline float HSum(V8 v) {
  float s = 0.0f;
  for (int i = 0; i < 8; ++i) s += v[i];
  return s;
}

typedef V8 Vec;
constexpr int64_t kLanes = 8;               // floats per vector
constexpr int64_t kTileC = 64;              // slots per tile (the online softmax's step)
constexpr int64_t kNV = kTileC / 8;         // vectors per query's tile of scores
constexpr int64_t kCB = 4;                  // score vectors (32 slots) per register block

// sc[i, :] = qs[i, :] . kt[:, 0:kTileC] for queries [i0, r), RB at a time (then RB/2, ...), in
// blocks of RB queries x kCB vectors of slots (8 accumulators, kCB keys, RB broadcasts); kt's
// rows are ldk floats apart.
template <int64_t HD, int64_t RB>
void Scores(const float* qs, const float* kt, int64_t ldk, float* sc, int64_t i0, int64_t r) {
  for (; i0 + RB <= r; i0 += RB) {
    const float* qb = qs + i0 * HD;
    for (int64_t c0 = 0; c0 < kTileC; c0 += kCB * 8) {
      V8 a[RB][kCB];
      for (int64_t i = 0; i < RB; ++i) {
        for (int64_t v = 0; v < kCB; ++v) a[i][v] = Splat(0.0f);
      }
      for (int64_t d = 0; d < HD; ++d) {
        V8 kv[kCB];
#pragma GCC unroll 4
        for (int64_t v = 0; v < kCB; ++v) kv[v] = LoadReg(kt + d * ldk + c0 + 8 * v);
#pragma GCC unroll 4
        for (int64_t i = 0; i < RB; ++i) {
          const float qd = qb[i * HD + d];
#pragma GCC unroll 4
          for (int64_t v = 0; v < kCB; ++v) a[i][v] += qd * kv[v];
        }
      }
      for (int64_t i = 0; i < RB; ++i) {
        for (int64_t v = 0; v < kCB; ++v) Store(sc + (i0 + i) * kTileC + c0 + 8 * v, a[i][v]);
      }
    }
  }
  if constexpr (RB > 1) Scores<HD, RB / 2>(qs, kt, ldk, sc, i0, r);
}

// acc[i, :] += sum_j p[i, j] vals[j, :] over the tile's tn slots, for queries [i0, r), RB at a
// time (then RB/2, ...), in blocks of RB queries x 4 vectors (32) of the head dimension.
template <int64_t HD, int64_t RB>
void Values(const float* p, const float* vals, int64_t tn, float* acc, int64_t i0, int64_t r) {
  constexpr int64_t HV = 4;
  static_assert(HD % (8 * HV) == 0, "head size: a multiple of 32");
  for (; i0 + RB <= r; i0 += RB) {
    for (int64_t h0 = 0; h0 < HD; h0 += 8 * HV) {
      V8 a[RB][HV];
      for (int64_t i = 0; i < RB; ++i) {
        for (int64_t h = 0; h < HV; ++h) a[i][h] = Load(acc + (i0 + i) * HD + h0 + 8 * h);
      }
      for (int64_t j = 0; j < tn; ++j) {
        V8 vv[HV];
#pragma GCC unroll 4
        for (int64_t h = 0; h < HV; ++h) vv[h] = LoadReg(vals + j * HD + h0 + 8 * h);
#pragma GCC unroll 4
        for (int64_t i = 0; i < RB; ++i) {
          const float pij = p[(i0 + i) * kTileC + j];
#pragma GCC unroll 4
          for (int64_t h = 0; h < HV; ++h) a[i][h] += pij * vv[h];
        }
      }
      for (int64_t i = 0; i < RB; ++i) {
        for (int64_t h = 0; h < HV; ++h) Store(acc + (i0 + i) * HD + h0 + 8 * h, a[i][h]);
      }
    }
  }
  if constexpr (RB > 1) Values<HD, RB / 2>(p, vals, tn, acc, i0, r);
}
#endif

// One (b, k) pair on the tiled path: the same contract as Pair.
template <int64_t HD>
void TiledPair(const float* q, const float* keys, const float* vals, int64_t n, int64_t r,
               int64_t, int64_t s, float scale, float* m_out, float* den_out, float* acc_out,
               std::vector<float>& buf, int64_t lc) {
  const int64_t before = n;
  n = lc > 0 ? std::min(n + lc, s) : n;       // the slots any query sees
#if defined(__AVX512F__)
  constexpr int64_t RB = 4;                              // score rows per register block
  constexpr int64_t RB2 = HD >= 128 ? 2 : 128 / HD;      // value rows per register block
#else
  constexpr int64_t RB = 2;
  constexpr int64_t RB2 = 2;
#endif
  std::fill(m_out, m_out + r, kNeg);
  std::fill(den_out, den_out + r, 0.0f);
  std::fill(acc_out, acc_out + r * HD, 0.0f);
  if (n <= 0) return;
  buf.resize(r * HD + r * kTileC + HD * kTileC + kLanes * r);
  float* qs = buf.data();
  float* sc = qs + r * HD;
  float* ktail = sc + r * kTileC;
  float* dens = ktail + HD * kTileC;   // [r, kLanes]: each query's softmax sum, lane by lane
  std::fill(dens, dens + kLanes * r, 0.0f);
  for (int64_t i = 0; i < r * HD; ++i) qs[i] = q[i] * scale;
  for (int64_t j0 = 0; j0 < n; j0 += kTileC) {
    const int64_t tn = std::min(kTileC, n - j0);
    const float* kt = keys + j0;
    int64_t ldk = s;
    if (j0 + kTileC > s) {            // the tile would run past the capacity: a padded copy
      for (int64_t d = 0; d < HD; ++d) {
        std::copy(keys + d * s + j0, keys + d * s + j0 + tn, ktail + d * kTileC);
        std::fill(ktail + d * kTileC + tn, ktail + (d + 1) * kTileC, 0.0f);
      }
      kt = ktail;
      ldk = kTileC;
    }
    Scores<HD, RB>(qs, kt, ldk, sc, 0, r);
    for (int64_t i = 0; i < r; ++i) {   // online softmax: rescale what came before
      float* row = sc + i * kTileC;
      const int64_t ti = lc > 0 ? std::clamp<int64_t>(Seen(before, i, lc, s) - j0, 0, tn) : tn;
      if (ti == 0) {                    // a causal query whose slots all came before this tile
        std::fill(row, row + kTileC, 0.0f);
        continue;
      }
      std::fill(row + ti, row + kTileC, kNeg);
      Vec mx = Load(row);
      for (int64_t v = 1; v < kNV; ++v) {
        const Vec x = Load(row + kLanes * v);
        mx = x > mx ? x : mx;
      }
      const float m_new = std::max(m_out[i], HMax(mx));
      const float alpha = ExpNonPositive(m_out[i] - m_new);
      Vec sum = Splat(0.0f);
      for (int64_t v = 0; v < kNV; ++v) {
        const Vec e = ExpV(Load(row + kLanes * v) - m_new);
        Store(row + kLanes * v, e);
        sum += e;
      }
      Store(dens + kLanes * i, Load(dens + kLanes * i) * alpha + sum);   // summed across lanes last
      m_out[i] = m_new;
      if (alpha != 1.0f) {
        float* a = acc_out + i * HD;
        for (int64_t d = 0; d < HD; d += kLanes) Store(a + d, Load(a + d) * alpha);
      }
    }
    Values<HD, RB2>(sc, vals + j0 * HD, tn, acc_out, 0, r);
  }
  for (int64_t i = 0; i < r; ++i) den_out[i] = HSum(Load(dens + kLanes * i));
}

using PairFn = void (*)(const float*, const float*, const float*, int64_t, int64_t, int64_t,
                        int64_t, float, float*, float*, float*, std::vector<float>&, int64_t);

PairFn PickPair(int64_t hd) {
  switch (hd) {
    case 32: return TiledPair<32>;
    case 64: return TiledPair<64>;
    case 128: return TiledPair<128>;
    default: return Pair;
  }
}

struct Work {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  int64_t total = 0;
  std::mutex mu;
  std::condition_variable cv;
};

// Runs task(p, scratch) for p in [0, total) over the pool (and the calling thread, so the call
// finishes even if no helper ever runs); returns when every task has.
template <typename Task>
void ParallelFor(ffi::ThreadPool& pool, int64_t total, Task task) {
  auto work = std::make_shared<Work>();
  work->total = total;
  auto run = [=](Work& w) {
    std::vector<float> scratch;
    int64_t finished = 0;
    for (int64_t p; (p = w.next.fetch_add(1)) < w.total;) {
      task(p, scratch);
      ++finished;
    }
    if (finished && w.done.fetch_add(finished) + finished == w.total) {
      std::lock_guard<std::mutex> lock(w.mu);
      w.cv.notify_all();
    }
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), total) - 1;
  for (int64_t t = 0; t < helpers; ++t) {
    pool.Schedule([work, run] { run(*work); });
  }
  run(*work);
  std::unique_lock<std::mutex> lock(work->mu);
  work->cv.wait(lock, [&] { return work->done.load() == work->total; });
}

// k [Ly, B, K, hd, S] and v [Ly, B, K, S, hd].
bool CacheShapes(ffi::Span<const int64_t> kd, ffi::Span<const int64_t> vd) {
  return kd.size() == 5 && vd.size() == 5 && kd[0] == vd[0] && kd[1] == vd[1] &&
         kd[2] == vd[2] && kd[3] == vd[4] && kd[4] == vd[3];
}

// The partials of layer `li` over slots [0, length[b]) for every (b, k) pair, shared out over
// the pool. With `knew`/`vnew` ([B, K, L, hd]), each pair first writes its chunk's L keys and
// values into slots [length[b], length[b] + L) of kout/vout (slots past the capacity are dropped)
// and then reads causally (see the top of the file), so a layer's cache write and its whole
// attention are one pass and one custom call.
ffi::Error Run(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32>& q, const float* k_all,
               const float* v_all, ffi::Span<const int64_t> kd, int32_t li,
               const int32_t* len, float* mo, float* dno, float* ao, float scale,
               const float* knew, const float* vnew, int64_t l, float* kout, float* vout) {
  auto qd = q.dimensions();
  if (kd.size() != 5 || qd.size() != 4) {
    return ffi::Error::InvalidArgument("cache_attention: want q [B,K,R,hd], k [Ly,B,K,hd,S]");
  }
  Shape sh{kd[0], kd[1], kd[2], qd[2], kd[3], kd[4]};
  if (qd[0] != sh.b || qd[1] != sh.kh || qd[3] != sh.hd) {
    return ffi::Error::InvalidArgument("cache_attention: q and cache shapes disagree");
  }
  if (li < 0 || li >= sh.layers) return ffi::Error::InvalidArgument("cache_attention: layer");
  const int64_t per_layer = sh.b * sh.kh * sh.hd * sh.s;
  const float* kbase = k_all + li * per_layer;
  const float* vbase = v_all + li * per_layer;
  const float* qbase = q.typed_data();

  const PairFn pair = PickPair(sh.hd);
  ParallelFor(pool, sh.b * sh.kh, [=](int64_t p, std::vector<float>& sc) {
    const int64_t bi = p / sh.kh;
    const int64_t n = std::min<int64_t>(std::max<int32_t>(len[bi], 0), sh.s);
    const int64_t off = p * sh.hd * sh.s;
    if (knew != nullptr) {            // before the read, which sees the chunk's own slots
      float* kt = kout + li * per_layer + off;             // [hd, S]
      float* vs = vout + li * per_layer + off;             // [S, hd]
      const float* kn = knew + p * l * sh.hd;              // [L, hd]
      const float* vn = vnew + p * l * sh.hd;
      for (int64_t j = 0; j < l && n + j < sh.s; ++j) {
        for (int64_t d = 0; d < sh.hd; ++d) kt[d * sh.s + n + j] = kn[j * sh.hd + d];
        std::copy(vn + j * sh.hd, vn + (j + 1) * sh.hd, vs + (n + j) * sh.hd);
      }
    }
    pair(qbase + p * sh.r * sh.hd, kbase + off, vbase + off, n, sh.r, sh.hd, sh.s, scale,
         mo + p * sh.r, dno + p * sh.r, ao + p * sh.r * sh.hd, sc, knew != nullptr ? l : 0);
  });
  return ffi::Error::Success();
}

// y[M, N] = x[M, K] @ w[K, N] for a few rows (decode steps: M = the batch), where the cost is
// reading w once. XLA:CPU's products read an 8-row step's weights at ~5-6 GB/s on one thread;
// here the threads split K into ranges, each streams its rows of w front to back (8 at a time,
// so 8 sequential streams) into its own [M, N] partial sums, and the partials are added last.
constexpr int64_t kRowsK = 8;
constexpr int64_t kMaxRows = 16;

#if defined(__AVX512F__)
// Rows [0, MR) of y (ldy apart) += x[:, k0:k1] @ w[k0:k1, :]: MR accumulators per 16 columns
// stay in registers while 8 rows of w stream in.
template <int64_t MR>
void MatmulRows(const float* x, int64_t ldx, const float* w, int64_t n, int64_t k0, int64_t k1,
                float* y) {
  const int64_t nv = n / 16 * 16;
  for (int64_t kb = k0; kb < k1; kb += kRowsK) {
    const int64_t kk = std::min(kRowsK, k1 - kb);
    const float* wb = w + kb * n;
    for (int64_t j = 0; j < nv; j += 16) {
      V16 a[MR];
      for (int64_t r = 0; r < MR; ++r) a[r] = Load(y + r * n + j);
      for (int64_t i = 0; i < kk; ++i) {
        const V16 wv = Load(wb + i * n + j);
        for (int64_t r = 0; r < MR; ++r) a[r] += Splat(x[r * ldx + kb + i]) * wv;
      }
      for (int64_t r = 0; r < MR; ++r) Store(y + r * n + j, a[r]);
    }
    for (int64_t j = nv; j < n; ++j) {
      for (int64_t r = 0; r < MR; ++r) {
        float acc = 0.0f;
        for (int64_t i = 0; i < kk; ++i) acc += x[r * ldx + kb + i] * wb[i * n + j];
        y[r * n + j] += acc;
      }
    }
  }
}

#else
// MR accumulators per 8 columns (MR <= 8: 16 registers), x's block xs [kk, MR] packed (so its
// broadcasts need no address register each), y's rows n floats apart.
template <int64_t MR>
inline void MatmulCols(const float* xs, const float* wb, int64_t n, int64_t kk, float* y,
                       int64_t j) {
  V8 a[MR];
  for (int64_t r = 0; r < MR; ++r) a[r] = Load(y + r * n + j);
  for (int64_t i = 0; i < kk; ++i) {
    const V8 wv = Load(wb + i * n + j);
    for (int64_t r = 0; r < MR; ++r) a[r] += xs[i * MR + r] * wv;
  }
  for (int64_t r = 0; r < MR; ++r) Store(y + r * n + j, a[r]);
}

// Rows [0, MR) of y += x[:, k0:k1] @ w[k0:k1, :], 8 rows of w at a time: per 8 columns, rows
// [0, 8) then [8, MR) of y, the second block reading the 8 vectors of w again from L1.
template <int64_t MR>
void MatmulRows(const float* x, int64_t ldx, const float* w, int64_t n, int64_t k0, int64_t k1,
                float* y) {
  constexpr int64_t R1 = MR > 8 ? 8 : MR, R2 = MR - R1;
  const int64_t nv = n / 8 * 8;
  float xs1[kRowsK * R1], xs2[kRowsK * (R2 > 0 ? R2 : 1)];
  for (int64_t kb = k0; kb < k1; kb += kRowsK) {
    const int64_t kk = std::min(kRowsK, k1 - kb);
    const float* wb = w + kb * n;
    for (int64_t i = 0; i < kk; ++i) {
      for (int64_t r = 0; r < R1; ++r) xs1[i * R1 + r] = x[r * ldx + kb + i];
      for (int64_t r = 0; r < R2; ++r) xs2[i * R2 + r] = x[(R1 + r) * ldx + kb + i];
    }
    for (int64_t j = 0; j < nv; j += 8) {
      MatmulCols<R1>(xs1, wb, n, kk, y, j);
      if constexpr (R2 > 0) MatmulCols<R2>(xs2, wb, n, kk, y + R1 * n, j);
    }
    for (int64_t j = nv; j < n; ++j) {
      for (int64_t r = 0; r < MR; ++r) {
        float acc = 0.0f;
        for (int64_t i = 0; i < kk; ++i) acc += x[r * ldx + kb + i] * wb[i * n + j];
        y[r * n + j] += acc;
      }
    }
  }
}
#endif

template <int64_t... R>
void MatmulBlock(int64_t mr, const float* x, int64_t ldx, const float* w, int64_t n, int64_t k0,
                 int64_t k1, float* y, std::integer_sequence<int64_t, R...>) {
  ((mr == R + 1 ? MatmulRows<R + 1>(x, ldx, w, n, k0, k1, y) : void()), ...);
}

// y[M, N] = x[M, K] @ w[K, N] over w's rows [k0, k1), 16 rows of y at a time.
void MatmulRange(const float* x, const float* w, int64_t m, int64_t k, int64_t n, int64_t k0,
                 int64_t k1, float* y) {
  std::fill(y, y + m * n, 0.0f);
  for (int64_t r0 = 0; r0 < m; r0 += kMaxRows) {
    MatmulBlock(std::min(kMaxRows, m - r0), x + r0 * k, k, w, n, k0, k1, y + r0 * n,
                std::make_integer_sequence<int64_t, kMaxRows>{});
  }
}

ffi::Error SmallMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                           ffi::Buffer<ffi::F32> w, ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[0]) {
    return ffi::Error::InvalidArgument("small_matmul: want x [M, K] and w [K, N]");
  }
  const int64_t m = xd[0], k = xd[1], n = wd[1];
  // Ranges of whole 8-row groups, at least 64 rows of w each.
  const int64_t parts = std::max<int64_t>(
      1, std::min<int64_t>(pool.num_threads(), k / (8 * kRowsK)));
  const int64_t per = ((k + kRowsK - 1) / kRowsK + parts - 1) / parts * kRowsK;
  std::vector<std::vector<float>> partial(parts);
  float* out = y->typed_data();
  ParallelFor(pool, parts, [&](int64_t p, std::vector<float>&) {
    const int64_t k0 = std::min(k, p * per), k1 = std::min(k, (p + 1) * per);
    float* dst = out;
    if (p > 0) {
      partial[p].resize(m * n);
      dst = partial[p].data();
    }
    MatmulRange(x.typed_data(), w.typed_data(), m, k, n, k0, k1, dst);
  });
  for (int64_t p = 1; p < parts; ++p) {
    const float* src = partial[p].data();
    for (int64_t i = 0; i < m * n; ++i) out[i] += src[i];
  }
  return ffi::Error::Success();
}

ffi::Error CacheAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                              ffi::Buffer<ffi::F32> k_all, ffi::Buffer<ffi::F32> v_all,
                              ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> length,
                              ffi::ResultBuffer<ffi::F32> m, ffi::ResultBuffer<ffi::F32> den,
                              ffi::ResultBuffer<ffi::F32> acc, float scale) {
  if (!CacheShapes(k_all.dimensions(), v_all.dimensions())) {
    return ffi::Error::InvalidArgument("cache_attention: want k [Ly,B,K,hd,S], v [Ly,B,K,S,hd]");
  }
  return Run(pool, q, k_all.typed_data(), v_all.typed_data(), k_all.dimensions(),
             layer.typed_data()[0], length.typed_data(), m->typed_data(), den->typed_data(),
             acc->typed_data(), scale, nullptr, nullptr, 0, nullptr, nullptr);
}

// The chunk's keys and values written into the cache, which XLA passes in place (the results
// alias the cache operands; a copy first if it ever does not), then the causal partials over the
// cache and the chunk.
ffi::Error CacheAttentionWriteImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                                   ffi::Buffer<ffi::F32> k_all, ffi::Buffer<ffi::F32> v_all,
                                   ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> length,
                                   ffi::Buffer<ffi::F32> k_new, ffi::Buffer<ffi::F32> v_new,
                                   ffi::ResultBuffer<ffi::F32> m, ffi::ResultBuffer<ffi::F32> den,
                                   ffi::ResultBuffer<ffi::F32> acc,
                                   ffi::ResultBuffer<ffi::F32> k_out,
                                   ffi::ResultBuffer<ffi::F32> v_out, float scale) {
  auto kd = k_all.dimensions();
  auto nd = k_new.dimensions();
  if (!CacheShapes(kd, v_all.dimensions()) || !(k_out->dimensions() == kd) ||
      !(v_out->dimensions() == v_all.dimensions()) || nd.size() != 4 ||
      !(v_new.dimensions() == nd) || nd[0] != kd[1] || nd[1] != kd[2] || nd[3] != kd[3]) {
    return ffi::Error::InvalidArgument(
        "cache_attention_write: want k [Ly,B,K,hd,S], v [Ly,B,K,S,hd], k_new, v_new [B,K,L,hd]");
  }
  float* ko = k_out->typed_data();
  float* vo = v_out->typed_data();
  const size_t bytes = k_all.size_bytes();
  if (ko != k_all.typed_data()) std::copy_n(k_all.typed_data(), bytes / 4, ko);
  if (vo != v_all.typed_data()) std::copy_n(v_all.typed_data(), bytes / 4, vo);
  return Run(pool, q, ko, vo, kd, layer.typed_data()[0], length.typed_data(), m->typed_data(),
             den->typed_data(), acc->typed_data(), scale, k_new.typed_data(),
             v_new.typed_data(), nd[2], ko, vo);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxagentCacheAttention, CacheAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxagentCacheAttentionWrite, CacheAttentionWriteImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxagentSmallMatmul, SmallMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

// Floats per vector of this build (16: the AVX-512 path; 8: AVX2). Python reads it to keep XLA's
// own few-row products on 8-lane builds, where they measured faster than SmallMatmul.
extern "C" int JaxagentVectorLanes() { return static_cast<int>(kLanes); }
