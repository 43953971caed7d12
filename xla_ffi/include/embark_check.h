// Operand validation with messages that say which kernel, which operand, what was expected
// and what was got. The Python ops validate their arguments first; these checks guard the
// FFI boundary itself (a direct jax.ffi.ffi_call, or a Python/C++ ABI mismatch), where an
// unchecked shape would read or write out of bounds. The per-target checks built from it,
// shared by the CPU and CUDA handlers, are in embark_operands.h.
#pragma once

#include <cstdint>
#include <string>
#include <utility>

#include "embark_ffi.h"

namespace embark {

// "float32", "int64", ... for messages.
inline const char* DTypeName(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::PRED: return "bool";
    case ffi::DataType::S8: return "int8";
    case ffi::DataType::S16: return "int16";
    case ffi::DataType::S32: return "int32";
    case ffi::DataType::S64: return "int64";
    case ffi::DataType::U8: return "uint8";
    case ffi::DataType::U16: return "uint16";
    case ffi::DataType::U32: return "uint32";
    case ffi::DataType::U64: return "uint64";
    case ffi::DataType::F16: return "float16";
    case ffi::DataType::F32: return "float32";
    case ffi::DataType::F64: return "float64";
    case ffi::DataType::BF16: return "bfloat16";
    default: return "an unsupported dtype";
  }
}

// "[3, 4]"; "[]" for a scalar.
template <typename Dims>
std::string ShapeString(const Dims& dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(dims[i]);
  }
  return s + "]";
}

// Chained checks of one handler's operands. The first failure is kept and later checks are
// skipped (they may rely on an earlier one, e.g. a rank before a dimension):
//
//   Check c("sparse_update");
//   c.Rank("table", table, 2, "[V, D]").Dim("grads", grads, 1, d, "D, the table's width");
//   if (c.failed()) return c.error();
//
// `B` is any FFI buffer (AnyBuffer, Buffer<dtype>, or *result).
class Check {
 public:
  explicit Check(const char* kernel) : kernel_(kernel) {}

  bool failed() const { return !message_.empty(); }
  ffi::Error error() const { return InvalidArgument(std::string(kernel_) + ": " + message_); }

  // The operand has `rank` dimensions; `layout` names them, e.g. "[V, D]".
  template <typename B>
  Check& Rank(const char* operand, const B& b, size_t rank, const char* layout) {
    if (failed() || b.dimensions().size() == rank) return *this;
    return Fail(std::string(operand) + " must be " + layout + " (rank " + std::to_string(rank) +
                "), got shape " + ShapeString(b.dimensions()));
  }

  // Dimension `axis` of the operand is `want`; `what` says where `want` comes from.
  template <typename B>
  Check& Dim(const char* operand, const B& b, size_t axis, int64_t want, const char* what) {
    if (failed()) return *this;
    auto dims = b.dimensions();
    if (axis < dims.size() && dims[axis] == want) return *this;
    return Fail(std::string(operand) + " must have dimension " + std::to_string(axis) + " = " +
                std::to_string(want) + " (" + what + "), got shape " + ShapeString(dims));
  }

  // The operand has exactly `want` elements; `what` says where `want` comes from.
  template <typename B>
  Check& Count(const char* operand, const B& b, int64_t want, const char* what) {
    if (failed() || static_cast<int64_t>(b.element_count()) == want) return *this;
    return Fail(std::string(operand) + " must have " + std::to_string(want) + " elements (" +
                what + "), got shape " + ShapeString(b.dimensions()));
  }

  // The operand has the shape of `like`; `what` says why (e.g. an aliased output).
  template <typename B, typename L>
  Check& SameShape(const char* operand, const B& b, const L& like, const char* what) {
    if (failed()) return *this;
    auto x = b.dimensions();
    auto y = like.dimensions();
    bool same = x.size() == y.size();
    for (size_t i = 0; same && i < x.size(); ++i) same = x[i] == y[i];
    if (same) return *this;
    return Fail(std::string(operand) + " must have shape " + ShapeString(y) + " (" + what +
                "), got shape " + ShapeString(x));
  }

  // The operand has at least `need` elements; `what` says why.
  template <typename B>
  Check& MinCount(const char* operand, const B& b, int64_t need, const std::string& what) {
    if (failed() || static_cast<int64_t>(b.element_count()) >= need) return *this;
    return Fail(std::string(operand) + " must have at least " + std::to_string(need) +
                " elements (" + what + "), got shape " + ShapeString(b.dimensions()));
  }

  Check& IdType(const char* operand, ffi::DataType t) {
    if (failed() || IsIdType(t)) return *this;
    return Fail(std::string(operand) + " must be int32 or int64, got " + DTypeName(t));
  }

  Check& FloatType(const char* operand, ffi::DataType t) {
    if (failed() || IsFloatType(t)) return *this;
    return Fail(std::string(operand) + " must be float32 or bfloat16, got " + DTypeName(t));
  }

  // The operand's dtype is `want`; `what` says where `want` comes from (may be empty).
  Check& Type(const char* operand, ffi::DataType t, ffi::DataType want, const char* what = "") {
    if (failed() || t == want) return *this;
    std::string why = *what ? std::string(" (") + what + ")" : "";
    return Fail(std::string(operand) + " must be " + DTypeName(want) + why + ", got " +
                DTypeName(t));
  }

  // An id attribute is one of the ABI's ids 0..count-1, whose names are names[id].
  Check& Attr(const char* attr, int64_t value, const char* const* names, int64_t count) {
    if (failed() || (value >= 0 && value < count)) return *this;
    std::string valid;
    for (int64_t i = 0; i < count; ++i) {
      valid += (i ? ", " : "") + std::to_string(i) + " (" + names[i] + ")";
    }
    return Fail("attribute " + std::string(attr) + " must be one of " + valid + ", got " +
                std::to_string(value));
  }

  // A condition no other check covers; `message` says what was expected and what came.
  Check& Require(bool ok, const std::string& message) {
    return failed() || ok ? *this : Fail(message);
  }

 private:
  Check& Fail(std::string message) {
    message_ = std::move(message);
    return *this;
  }

  const char* kernel_;
  std::string message_;
};

// An operand as a target's operands struct holds it: a result as its buffer.
template <typename T>
T Unwrapped(T operand) {
  return operand;
}
template <typename T>
T Unwrapped(ffi::Result<T> result) {
  return *result;
}

// The implementation of a handler whose operands (all that XLA binds after the context, in
// the binding's order) initialise one struct, Ops: both backends' handlers of a target take
// the same struct, so its operand list is written once. The call runs check(ops), the
// contract both backends share, then, if it holds, run(ctx, ops), the backend's kernel.
template <typename Ops, typename Run>
auto CheckedHandler(ffi::Error (*check)(const Ops&), Run run) {
  return [check, run](auto ctx, auto... operands) -> ffi::Error {
    const Ops ops{Unwrapped(std::move(operands))...};
    ffi::Error err = check(ops);
    if (err.failure()) return err;
    return run(ctx, ops);
  };
}

}  // namespace embark
