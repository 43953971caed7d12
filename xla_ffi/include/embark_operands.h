// The operand contract of each FFI target, checked by its CPU and its CUDA handler alike: one
// function per target, so both backends accept exactly the same calls and reject a bad one
// with the same message (kernel, operand, expected shape/dtype, actual). Checks that only
// one backend needs (e.g. the size of a CUDA workspace) stay in that backend.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "embark_abi.h"
#include "embark_check.h"
#include "embark_ffi.h"

// The operands of the in-place update targets as XLA binds them, after the handler's context
// (a thread pool on the CPU, a stream on CUDA): one list, so both backends bind the same call.
// The table and its two slots come first; the update targets return them aliased.
#define EMBARK_TABLE_AND_SLOTS_ARGS                      \
    .Arg<xla::ffi::AnyBuffer>()             /* table */  \
    .Arg<xla::ffi::Buffer<xla::ffi::F32>>() /* slot a */ \
    .Arg<xla::ffi::Buffer<xla::ffi::F32>>() /* slot b */
#define EMBARK_TABLE_AND_SLOTS_RETS                                \
    .Ret<xla::ffi::AnyBuffer>()             /* table (aliased) */  \
    .Ret<xla::ffi::Buffer<xla::ffi::F32>>() /* slot a (aliased) */ \
    .Ret<xla::ffi::Buffer<xla::ffi::F32>>() /* slot b (aliased) */
// grads [S, D], ids [N], segment_ids [N], scale [N], hparams: the fused backward's inputs
#define EMBARK_GRAD_ARGS                                       \
    .Arg<xla::ffi::AnyBuffer>()             /* grads */       \
    .Arg<xla::ffi::AnyBuffer>()             /* ids */         \
    .Arg<xla::ffi::AnyBuffer>()             /* segment_ids */ \
    .Arg<xla::ffi::Buffer<xla::ffi::F32>>() /* scale */       \
    .Arg<xla::ffi::Buffer<xla::ffi::F32>>() /* hparams */
// embark_sparse_grad_update: updated table and slots, num_unique [], workspace
#define EMBARK_SPARSE_GRAD_UPDATE_OPERANDS                                   \
    EMBARK_TABLE_AND_SLOTS_ARGS EMBARK_GRAD_ARGS EMBARK_TABLE_AND_SLOTS_RETS \
    .Ret<xla::ffi::Buffer<xla::ffi::S32>>() /* num_unique */                 \
    .Ret<xla::ffi::AnyBuffer>()             /* workspace */                  \
    .Attr<int64_t>("optimizer")                                              \
    .Attr<int64_t>("per_id")
// embark_sparse_grad_stage: table [..., R, D] and slots, ids, segment_ids, scale, hparams
// (elements past the ABI's are never read: values the update must wait for), the staging
// buffers (values, staged slot a, b: never read; the caller aliases them to the staged results
// so that a step's staging memory is the last step's, not fresh pages, or passes [0] dummies),
// then the output gradient as one or more [S_k, D] pieces, rows one after the other;
// rows [C], the rows' previous values [C, D] and slots, num_unique, finite, workspace, and the
// table and slots updated in place (aliased)
#define EMBARK_SPARSE_GRAD_STAGE_OPERANDS                       \
    EMBARK_TABLE_AND_SLOTS_ARGS                                 \
    .Arg<xla::ffi::AnyBuffer>()             /* ids */           \
    .Arg<xla::ffi::AnyBuffer>()             /* segment_ids */   \
    .Arg<xla::ffi::Buffer<xla::ffi::F32>>() /* scale */         \
    .Arg<xla::ffi::Buffer<xla::ffi::F32>>() /* hparams */       \
    .Arg<xla::ffi::AnyBuffer>()             /* staging values */\
    .Arg<xla::ffi::AnyBuffer>()             /* staging slot a */\
    .Arg<xla::ffi::AnyBuffer>()             /* staging slot b */\
    .RemainingArgs()                        /* grads pieces */  \
    .Ret<xla::ffi::AnyBuffer>()             /* rows */          \
    .Ret<xla::ffi::AnyBuffer>()             /* values */        \
    .Ret<xla::ffi::Buffer<xla::ffi::F32>>() /* staged slot a */ \
    .Ret<xla::ffi::Buffer<xla::ffi::F32>>() /* staged slot b */ \
    .Ret<xla::ffi::Buffer<xla::ffi::S32>>() /* num_unique */    \
    .Ret<xla::ffi::Buffer<xla::ffi::S32>>() /* finite */        \
    .Ret<xla::ffi::AnyBuffer>()             /* workspace */     \
    EMBARK_TABLE_AND_SLOTS_RETS                                 \
    .Attr<int64_t>("optimizer")                                 \
    .Attr<int64_t>("per_id")
// embark_commit_rows: rows [C], values [C, D], staged slots, commit [1 + k]; table and slots updated
#define EMBARK_COMMIT_ROWS_OPERANDS                             \
    EMBARK_TABLE_AND_SLOTS_ARGS                                 \
    .Arg<xla::ffi::AnyBuffer>()             /* rows */          \
    .Arg<xla::ffi::AnyBuffer>()             /* values */        \
    .Arg<xla::ffi::Buffer<xla::ffi::F32>>() /* staged slot a */ \
    .Arg<xla::ffi::Buffer<xla::ffi::F32>>() /* staged slot b */ \
    .Arg<xla::ffi::Buffer<xla::ffi::S32>>() /* commit */        \
    EMBARK_TABLE_AND_SLOTS_RETS                                 \
    .Attr<int64_t>("optimizer")

// embark_hash_find: keys [C, 2] u32, scores [C, 2] s32, ids [N, 2] u32, step []; slots [N]
#define EMBARK_HASH_FIND_OPERANDS                        \
    .Arg<xla::ffi::AnyBuffer>() /* keys */               \
    .Arg<xla::ffi::AnyBuffer>() /* scores */             \
    .Arg<xla::ffi::AnyBuffer>() /* ids */                \
    .Arg<xla::ffi::AnyBuffer>() /* step */               \
    .Ret<xla::ffi::AnyBuffer>() /* slots */              \
    .Attr<int64_t>("bucket_size")                        \
    .Attr<int64_t>("ttl")
// embark_hash_find_or_insert: the table and its eviction candidates (cand_keys [B * A, 2],
// cand_scores) updated in place, ids, step; slots [N], fresh [N], counts [6], workspace
#define EMBARK_HASH_FIND_OR_INSERT_OPERANDS                    \
    .Arg<xla::ffi::AnyBuffer>() /* keys */                     \
    .Arg<xla::ffi::AnyBuffer>() /* scores */                   \
    .Arg<xla::ffi::AnyBuffer>() /* cand_keys */                \
    .Arg<xla::ffi::AnyBuffer>() /* cand_scores */              \
    .Arg<xla::ffi::AnyBuffer>() /* ids */                      \
    .Arg<xla::ffi::AnyBuffer>() /* step */                     \
    .Ret<xla::ffi::AnyBuffer>() /* keys (aliased) */           \
    .Ret<xla::ffi::AnyBuffer>() /* scores (aliased) */         \
    .Ret<xla::ffi::AnyBuffer>() /* cand_keys (aliased) */      \
    .Ret<xla::ffi::AnyBuffer>() /* cand_scores (aliased) */    \
    .Ret<xla::ffi::AnyBuffer>() /* slots */                    \
    .Ret<xla::ffi::AnyBuffer>() /* fresh */                    \
    .Ret<xla::ffi::AnyBuffer>() /* counts */                   \
    .Ret<xla::ffi::AnyBuffer>() /* workspace (CUDA only) */    \
    .Attr<int64_t>("bucket_size")                              \
    .Attr<int64_t>("eviction")                                 \
    .Attr<int64_t>("threshold")                                \
    .Attr<int64_t>("ttl")

namespace embark {

using F32Buffer = ffi::Buffer<ffi::F32>;
using S32Buffer = ffi::Buffer<ffi::S32>;

// embark_segment_sum: values [N, D] f32/bf16, segment_ids [N] int, output [S, D] as values.
inline ffi::Error CheckSegmentSum(const ffi::AnyBuffer& values, const ffi::AnyBuffer& seg,
                                  const ffi::AnyBuffer& out) {
  Check c("segment_sum");
  c.Rank("values", values, 2, "[N, D]").Rank("output", out, 2, "[S, D]");
  if (c.failed()) return c.error();
  c.Count("segment_ids", seg, values.dimensions()[0], "[N], one per row of values")
      .IdType("segment_ids", seg.element_type())
      .Dim("output", out, 1, values.dimensions()[1], "D, the width of values")
      .FloatType("values", values.element_type())
      .Type("output", out.element_type(), values.element_type(), "the dtype of values");
  return c.failed() ? c.error() : ffi::Error::Success();
}

// embark_lookup_pool: table [V, D], ids [N], segment_ids [N], weights [N] f32 or [0] (every
// weight 1: no [N] array to fill and read), an ABI combiner id;
// workspace, then the output as one or more pieces [S_k, D], rows one after the other (S rows
// in all, or N for combiner NONE), all of the first piece's float dtype. Decodes them into
// `pieces`.
inline ffi::Error CheckLookupPool(const ffi::AnyBuffer& table, const ffi::AnyBuffer& ids,
                                  const ffi::AnyBuffer& seg, const ffi::AnyBuffer& weights,
                                  const ffi::RemainingRets& outs, int64_t combiner,
                                  std::vector<ffi::AnyBuffer>* pieces) {
  const int64_t n = static_cast<int64_t>(ids.element_count());
  Check c("lookup_pool");
  c.Rank("table", table, 2, "[V, D]")
      .Require(outs.size() > 0, "output: one or more [S_k, D] pieces expected, got none");
  int64_t rows = 0;
  for (size_t k = 0; k < outs.size() && !c.failed(); ++k) {
    auto piece = outs.get<ffi::AnyBuffer>(k);
    c.Require(!piece.has_error(), "output piece " + std::to_string(k) + " must be an array");
    if (c.failed()) break;
    pieces->push_back(**piece);
    const ffi::AnyBuffer& o = pieces->back();
    c.Rank("output", o, 2, "[S_k, D] pieces, or [N, D] for NONE");
    if (c.failed()) break;
    c.Dim("output", o, 1, table.dimensions()[1], "D, the table's width")
        .FloatType("output", o.element_type())
        .Type("output", o.element_type(), (*pieces)[0].element_type(),
              "the dtype of the first piece");
    rows += o.dimensions()[0];
  }
  if (c.failed()) return c.error();
  c.Count("segment_ids", seg, n, "[N], one per id")
      .IdType("ids", ids.element_type())
      .IdType("segment_ids", seg.element_type())
      .Type("weights", weights.element_type(), ffi::DataType::F32)
      .FloatType("table", table.element_type())
      .Attr("combiner", combiner, abi::kCombinerNames, abi::kNumCombiners);
  if (weights.element_count() != 0) c.Count("weights", weights, n, "[N], one per id, or [0]");
  if (combiner == static_cast<int64_t>(abi::Combiner::NONE)) {
    c.Require(rows == n, "output: combiner NONE gives a row per id: " + std::to_string(n) +
                             " rows expected, got " + std::to_string(rows));
  }
  return c.failed() ? c.error() : ffi::Error::Success();
}

// embark_unique: ids [N] int; unique_ids [C] as ids; inverse [N]; counts [C]; num_unique [].
inline ffi::Error CheckUnique(const ffi::AnyBuffer& ids, const ffi::AnyBuffer& unique,
                              const S32Buffer& inverse, const S32Buffer& counts,
                              const S32Buffer& num_unique) {
  Check c("unique");
  c.IdType("ids", ids.element_type())
      .Count("num_unique", num_unique, 1, "a scalar")
      .Type("unique_ids", unique.element_type(), ids.element_type(), "the dtype of ids")
      .Count("inverse", inverse, static_cast<int64_t>(ids.element_count()), "[N], one per id")
      .Count("counts", counts, static_cast<int64_t>(unique.element_count()),
             "[C], as unique_ids");
  return c.failed() ? c.error() : ffi::Error::Success();
}

// The id operands of the gradient kernels: ids [N] int, scale [N], and segment_ids [N] int
// unless per_id.
inline void CheckIdOperands(Check& c, const ffi::AnyBuffer& ids, const ffi::AnyBuffer& seg,
                            const F32Buffer& scale, bool per_id) {
  const int64_t n = static_cast<int64_t>(ids.element_count());
  c.IdType("ids", ids.element_type()).Count("scale", scale, n, "[N], one per id");
  if (!per_id) {
    c.Count("segment_ids", seg, n, "[N], one per id").IdType("segment_ids", seg.element_type());
  }
}

// The gradient operands shared by sparse_grad and sparse_grad_update: grads [S, D] f32/bf16
// of width d and the id operands.
inline void CheckGradOperands(Check& c, const ffi::AnyBuffer& grads, const ffi::AnyBuffer& ids,
                              const ffi::AnyBuffer& seg, const F32Buffer& scale, bool per_id,
                              int64_t d, const char* d_is) {
  c.Rank("grads", grads, 2, "[S, D]")
      .Dim("grads", grads, 1, d, d_is)
      .FloatType("grads", grads.element_type());
  CheckIdOperands(c, ids, seg, scale, per_id);
}

// embark_sparse_grad: the gradient operands; unique_rows [C] as ids; row_grads [C, D];
// num_unique [].
inline ffi::Error CheckSparseGrad(const ffi::AnyBuffer& grads, const ffi::AnyBuffer& ids,
                                  const ffi::AnyBuffer& seg, const F32Buffer& scale,
                                  const ffi::AnyBuffer& unique_rows, const F32Buffer& row_grads,
                                  const S32Buffer& num_unique, bool per_id) {
  Check c("sparse_grad");
  c.Rank("row_grads", row_grads, 2, "[C, D]").Count("num_unique", num_unique, 1, "a scalar");
  if (c.failed()) return c.error();
  CheckGradOperands(c, grads, ids, seg, scale, per_id, row_grads.dimensions()[1],
                    "D, the width of row_grads");
  c.Dim("row_grads", row_grads, 0, static_cast<int64_t>(unique_rows.element_count()),
        "C, the capacity of unique_rows")
      .Type("unique_rows", unique_rows.element_type(), ids.element_type(), "the dtype of ids");
  return c.failed() ? c.error() : ffi::Error::Success();
}

// The optimizer operands of sparse_update and sparse_grad_update: table [V, D] f32/bf16, an
// ABI optimizer id, a full hparams vector, and slots large enough for the table.
inline void CheckOptimizerOperands(Check& c, const ffi::AnyBuffer& table, const F32Buffer& slot_a,
                                   const F32Buffer& slot_b, const F32Buffer& hparams,
                                   int64_t optimizer) {
  c.Rank("table", table, 2, "[V, D]")
      .FloatType("table", table.element_type())
      .Attr("optimizer", optimizer, abi::kOptimizerNames, abi::kNumOptimizers)
      .MinCount("hparams", hparams, abi::kNumHparams, "one per ABI hyper-parameter");
  if (c.failed()) return;
  const int64_t vocab = table.dimensions()[0], d = table.dimensions()[1];
  const std::string why = std::string(abi::kOptimizerNames[optimizer]) + " on a [" +
                          std::to_string(vocab) + ", " + std::to_string(d) + "] table";
  c.MinCount("slot_a", slot_a, abi::SlotElements(optimizer, 0, vocab, d), why)
      .MinCount("slot_b", slot_b, abi::SlotElements(optimizer, 1, vocab, d), why);
}

// The table and slot outputs of the optimizer kernels alias their inputs (or are copies of
// them when XLA did not alias): same shapes and dtype, so the copy and the update stay inside.
inline void CheckOptimizerOutputs(Check& c, const ffi::AnyBuffer& table, const F32Buffer& slot_a,
                                  const F32Buffer& slot_b, const ffi::AnyBuffer& table_out,
                                  const F32Buffer& slot_a_out, const F32Buffer& slot_b_out) {
  c.SameShape("table output", table_out, table, "the table's: it is updated in place")
      .Type("table output", table_out.element_type(), table.element_type(), "the table's dtype")
      .SameShape("slot_a output", slot_a_out, slot_a, "slot_a's: it is updated in place")
      .SameShape("slot_b output", slot_b_out, slot_b, "slot_b's: it is updated in place");
}

// embark_sparse_update: the optimizer operands and outputs; rows [C] int; grads [C, D] f32.
inline ffi::Error CheckSparseUpdate(const ffi::AnyBuffer& table, const F32Buffer& slot_a,
                                    const F32Buffer& slot_b, const ffi::AnyBuffer& rows,
                                    const F32Buffer& grads, const F32Buffer& hparams,
                                    int64_t optimizer, const ffi::AnyBuffer& table_out,
                                    const F32Buffer& slot_a_out, const F32Buffer& slot_b_out) {
  Check c("sparse_update");
  CheckOptimizerOperands(c, table, slot_a, slot_b, hparams, optimizer);
  CheckOptimizerOutputs(c, table, slot_a, slot_b, table_out, slot_a_out, slot_b_out);
  if (c.failed()) return c.error();
  c.Rank("grads", grads, 2, "[C, D]")
      .Dim("grads", grads, 1, table.dimensions()[1], "D, the table's width")
      .IdType("rows", rows.element_type());
  if (c.failed()) return c.error();
  c.Count("rows", rows, grads.dimensions()[0], "[C], one per row of grads");
  return c.failed() ? c.error() : ffi::Error::Success();
}

// embark_sparse_grad_update: the optimizer operands and outputs, the gradient operands, and
// num_unique [].
inline ffi::Error CheckSparseGradUpdate(const ffi::AnyBuffer& table, const F32Buffer& slot_a,
                                        const F32Buffer& slot_b, const ffi::AnyBuffer& grads,
                                        const ffi::AnyBuffer& ids, const ffi::AnyBuffer& seg,
                                        const F32Buffer& scale, const F32Buffer& hparams,
                                        int64_t optimizer, bool per_id,
                                        const ffi::AnyBuffer& table_out,
                                        const F32Buffer& slot_a_out, const F32Buffer& slot_b_out,
                                        const S32Buffer& num_unique) {
  Check c("sparse_grad_update");
  CheckOptimizerOperands(c, table, slot_a, slot_b, hparams, optimizer);
  CheckOptimizerOutputs(c, table, slot_a, slot_b, table_out, slot_a_out, slot_b_out);
  c.Count("num_unique", num_unique, 1, "a scalar");
  if (c.failed()) return c.error();
  CheckGradOperands(c, grads, ids, seg, scale, per_id, table.dimensions()[1],
                    "D, the table's width");
  return c.failed() ? c.error() : ffi::Error::Success();
}

// The staged rows of sparse_grad_stage / commit_rows: rows [C] int; values [C, D] in the
// table's dtype; staged slots holding at least C rows of the optimizer's slot widths.
inline void CheckStagedRows(Check& c, const ffi::AnyBuffer& table, const ffi::AnyBuffer& rows,
                            const ffi::AnyBuffer& values, const F32Buffer& staged_a,
                            const F32Buffer& staged_b, int64_t optimizer, int64_t d) {
  const int64_t cap = static_cast<int64_t>(rows.element_count());
  c.IdType("rows", rows.element_type())
      .Rank("values", values, 2, "[C, D]")
      .Dim("values", values, 0, cap, "C, one per row")
      .Dim("values", values, 1, d, "D, the table's width")
      .Type("values", values.element_type(), table.element_type(), "the table's dtype");
  if (c.failed()) return;
  const std::string why = std::string(abi::kOptimizerNames[optimizer]) + " staged rows";
  c.MinCount("staged slot_a", staged_a, cap * abi::SlotRowWidth(optimizer, 0, d), why)
      .MinCount("staged slot_b", staged_b, cap * abi::SlotRowWidth(optimizer, 1, d), why);
}

// The output gradient of embark_sparse_grad_stage: one or more pieces [S_k, D], rows one
// after the other, all of the first piece's float dtype. Decodes them into `pieces`.
inline void CheckGradPieces(Check& c, const ffi::RemainingArgs& args, int64_t d,
                            std::vector<ffi::AnyBuffer>* pieces) {
  c.Require(args.size() > 0, "grads: one or more [S_k, D] pieces expected, got none");
  for (size_t k = 0; k < args.size() && !c.failed(); ++k) {
    auto piece = args.get<ffi::AnyBuffer>(k);
    c.Require(!piece.has_error(), "grads piece " + std::to_string(k) + " must be an array");
    if (c.failed()) return;
    pieces->push_back(*piece);
    const ffi::AnyBuffer& g = pieces->back();
    c.Rank("grads piece", g, 2, "[S_k, D]");
    if (c.failed()) return;
    c.Dim("grads piece", g, 1, d, "D, the table's width")
        .FloatType("grads piece", g.element_type())
        .Type("grads piece", g.element_type(), (*pieces)[0].element_type(),
              "the dtype of the first piece");
  }
}

// The rows of a table [..., D] of any rank >= 2 (its rows are all leading dimensions) and
// their width D.
struct TableRows {
  int64_t vocab, d;
};
inline TableRows RowsOf(const ffi::AnyBuffer& table) {
  const auto dims = table.dimensions();
  const int64_t d = dims[dims.size() - 1];
  return {d ? static_cast<int64_t>(table.element_count()) / d : 0, d};
}

// A table block [..., R, D] of any rank >= 2 (a shard_map block [1, R, D] is updated where
// it is: a reshape would make XLA copy the aliased buffer), a float dtype, an ABI optimizer
// id, and slots large enough for its rows.
inline TableRows CheckTableBlock(Check& c, const ffi::AnyBuffer& table, const F32Buffer& slot_a,
                                 const F32Buffer& slot_b, int64_t optimizer) {
  c.FloatType("table", table.element_type())
      .Attr("optimizer", optimizer, abi::kOptimizerNames, abi::kNumOptimizers);
  if (!c.failed() && table.dimensions().size() < 2) c.Rank("table", table, 2, "[..., R, D]");
  if (c.failed()) return {0, 0};
  const TableRows t = RowsOf(table);
  const std::string why = std::string(abi::kOptimizerNames[optimizer]) + " on " +
                          std::to_string(t.vocab) + " rows of width " + std::to_string(t.d);
  c.MinCount("slot_a", slot_a, abi::SlotElements(optimizer, 0, t.vocab, t.d), why)
      .MinCount("slot_b", slot_b, abi::SlotElements(optimizer, 1, t.vocab, t.d), why);
  return t;
}

// embark_sparse_grad_stage: the optimizer operands (the table is only read), the gradient
// operands (the gradient in pieces, decoded into `pieces`), the staged rows (C >= min(N, V)
// slots: at most that many distinct rows of the table can be touched) and num_unique [],
// finite [].
inline ffi::Error CheckSparseGradStage(const ffi::AnyBuffer& table, const F32Buffer& slot_a,
                                       const F32Buffer& slot_b, const ffi::AnyBuffer& ids,
                                       const ffi::AnyBuffer& seg, const F32Buffer& scale,
                                       const F32Buffer& hparams, const ffi::RemainingArgs& grads,
                                       int64_t optimizer, bool per_id,
                                       const ffi::AnyBuffer& rows, const ffi::AnyBuffer& values,
                                       const F32Buffer& staged_a, const F32Buffer& staged_b,
                                       const S32Buffer& num_unique, const S32Buffer& finite,
                                       const ffi::AnyBuffer& table_out,
                                       const F32Buffer& slot_a_out, const F32Buffer& slot_b_out,
                                       std::vector<ffi::AnyBuffer>* pieces) {
  Check c("sparse_grad_stage");
  const TableRows t = CheckTableBlock(c, table, slot_a, slot_b, optimizer);
  c.MinCount("hparams", hparams, abi::kNumHparams, "one per ABI hyper-parameter")
      .Count("num_unique", num_unique, 1, "a scalar")
      .Count("finite", finite, 1, "a scalar");
  if (c.failed()) return c.error();
  CheckOptimizerOutputs(c, table, slot_a, slot_b, table_out, slot_a_out, slot_b_out);
  const int64_t d = t.d;
  CheckGradPieces(c, grads, d, pieces);
  if (c.failed()) return c.error();
  CheckIdOperands(c, ids, seg, scale, per_id);
  const int64_t n = static_cast<int64_t>(ids.element_count());
  const int64_t vocab = t.vocab;
  c.MinCount("rows", rows, n < vocab ? n : vocab, "[C], C >= min(N, V): a slot per distinct row")
      .Type("rows", rows.element_type(), ids.element_type(), "the dtype of ids");
  CheckStagedRows(c, table, rows, values, staged_a, staged_b, optimizer, d);
  return c.failed() ? c.error() : ffi::Error::Success();
}

// embark_commit_rows' operands, in EMBARK_COMMIT_ROWS_OPERANDS' order (CheckedHandler).
struct CommitRowsOperands {
  ffi::AnyBuffer table;
  F32Buffer slot_a, slot_b;
  ffi::AnyBuffer rows, values;
  F32Buffer staged_a, staged_b;
  S32Buffer commit;
  ffi::AnyBuffer table_out;
  F32Buffer slot_a_out, slot_b_out;
  int64_t optimizer;
};

// embark_commit_rows: a table [..., D] of any rank >= 2 (its rows are all leading
// dimensions: a shard_map block [1, R, D] is updated without a reshape, which would make XLA
// copy the aliased buffer), its slots, the staged rows, and commit; the outputs
// alias the table and slots. commit is int32 [1 + k]: element 0 is the verdict; the other k
// are never read: they are values the write must wait for (XLA orders a call after the
// producers of its operands, so an update is not placed before a lookup that reads the same
// table, which would otherwise make XLA copy the whole table to keep them apart).
inline ffi::Error CheckCommitRows(const CommitRowsOperands& o) {
  const int64_t optimizer = o.optimizer;
  Check c("commit_rows");
  c.MinCount("commit", o.commit, 1, "the verdict, then any ordering operands");
  const TableRows t = CheckTableBlock(c, o.table, o.slot_a, o.slot_b, optimizer);
  if (c.failed()) return c.error();
  CheckOptimizerOutputs(c, o.table, o.slot_a, o.slot_b, o.table_out, o.slot_a_out,
                        o.slot_b_out);
  CheckStagedRows(c, o.table, o.rows, o.values, o.staged_a, o.staged_b, optimizer, t.d);
  return c.failed() ? c.error() : ffi::Error::Success();
}

}  // namespace embark
