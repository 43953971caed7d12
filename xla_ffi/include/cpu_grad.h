// Segment reduction of a lookup's gradient per unique row on the CPU, shared by sparse_grad,
// the fused backward + update kernel and the staged update.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpu_sort.h"
#include "embark_ffi.h"

namespace embark {

// The rows of an output gradient [S, D] given as one array or as pieces [S_k, D] one after
// the other (the staged update takes each feature's gradient as it is, with no concatenated
// copy): row src of the whole is row src - start[k] of the piece k that holds it. Pieces of
// one size but the last (each feature's [batch, D] gradient) find k by a division; others by
// a binary search, whose branches mispredict on every random row.
template <typename G>
struct GradRows {
  const G* const* piece;  // base of each piece
  const int64_t* start;   // [pieces + 1]: each piece's first row, then S
  int64_t pieces, d;
  int64_t uniform = 0;  // the rows of every piece but the last, where they are one size; or 0

  int64_t rows() const { return start[pieces]; }
  inline __attribute__((always_inline)) const G* Row(int64_t src) const {
    if (pieces == 1) return piece[0] + src * d;
    const int64_t k = uniform ? src / uniform
                              : (std::upper_bound(start, start + pieces, src) - start) - 1;
    return piece[k] + (src - start[k]) * d;
  }
};

// GradRows' `uniform` for piece starts [pieces + 1]: the common size of every piece but the
// last where there is one (the last no larger), else 0.
inline int64_t UniformPieceRows(const int64_t* start, int64_t pieces) {
  if (pieces < 2) return 0;
  const int64_t size = start[1] - start[0];
  if (size <= 0) return 0;
  for (int64_t k = 1; k + 1 < pieces; ++k) {
    if (start[k + 1] - start[k] != size) return 0;
  }
  return start[pieces] - start[pieces - 1] <= size ? size : 0;
}

// A one-piece GradRows over grads [rows, d]; holds the arrays the view points into.
template <typename G>
struct OneGrad {
  const G* base;
  int64_t start[2];
  OneGrad(const G* grads, int64_t rows) : base(grads), start{0, rows} {}
  GradRows<G> View(int64_t d) const { return GradRows<G>{&base, start, 1, d}; }
};

// How many sorted ids ahead AccumulateRun prefetches an output-gradient row: the ids of a
// run come from random samples, so each row is a cache miss unless fetched early.
constexpr int64_t kGradAhead = 8;

// out[0..d) = sum over the k-th run of sorted ids of scale[i] * grads.Row(src(i)), with
// src(i) = i when per_id, else segment_ids[i]; sources outside [0, S) are skipped.
// Inlined into its callers so that their per-instruction-set copies vectorise it.
template <typename G>
inline __attribute__((always_inline)) void AccumulateRun(const SortedIds& s, const RawArray<int64_t>& starts, int64_t k,
                          const GradRows<G>& grads, int64_t d, const ffi::AnyBuffer& seg,
                          bool per_id, const float* scale, float* out) {
  const int64_t num_src = grads.rows();
  for (int64_t j = 0; j < d; ++j) out[j] = 0.0f;
  const int64_t end = starts[k + 1];
  const int64_t total = static_cast<int64_t>(s.positions.size());
  for (int64_t t = starts[k]; t < end; ++t) {
    const int64_t i = s.positions[t];
    const int64_t src = per_id ? i : LoadId(seg, i);
    if (src < 0 || src >= num_src) continue;
    if (t + kGradAhead < total) {  // the next runs' rows too: most runs are one or two ids
      const int64_t ahead = s.positions[t + kGradAhead];
      const int64_t nx = per_id ? ahead : LoadId(seg, ahead);
      if (nx >= 0 && nx < num_src) {
        PrefetchBytes(grads.Row(nx), d * static_cast<int64_t>(sizeof(G)));
      }
    }
    const G* __restrict g = grads.Row(src);
    float* __restrict o = out;
    const float c = scale[i];
    for (int64_t j = 0; j < d; ++j) o[j] += c * Elem<G>::Load(g, j);
  }
}

}  // namespace embark
