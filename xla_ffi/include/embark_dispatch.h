// Runtime dtype -> C++ type dispatch for the handlers of both backends. XLA hands a handler
// AnyBuffers whose dtype is only known at run time; the kernels are templates on the element
// types. Instead of an if/else chain per handler (and per combination of operands), a
// handler passes a generic lambda that receives a Tag<T> for the operand's element type:
//
//   return DispatchFloat<HostBf16>("segment_sum", "values", values.element_type(),
//                                  [&](auto tag) { using T = EMBARK_TYPE(tag); ... });
//
// The lambda returns ffi::Error or nothing (= success). An unsupported dtype returns the
// same message as Check::FloatType / Check::IdType. bfloat16 is a template parameter because
// each backend stores it in its own type: uint16_t on the CPU, __nv_bfloat16 on CUDA.
#pragma once

#include <cstdint>
#include <string>
#include <type_traits>

#include "embark_check.h"
#include "embark_ffi.h"

namespace embark {

// A type carried as a value, so a generic lambda can receive it.
template <typename T>
struct Tag {
  using type = T;
};

// The element type carried by a Tag<T> argument of a dispatched lambda.
#define EMBARK_TYPE(tag) typename decltype(tag)::type

namespace dispatch_detail {

template <typename T, typename Fn>
ffi::Error Invoke(Fn& fn) {
  if constexpr (std::is_void_v<decltype(fn(Tag<T>{}))>) {
    fn(Tag<T>{});
    return ffi::Error::Success();
  } else {
    return fn(Tag<T>{});
  }
}

inline ffi::Error Unsupported(const char* kernel, const char* operand, const char* expected,
                              ffi::DataType t) {
  return InvalidArgument(std::string(kernel) + ": " + operand + " must be " + expected +
                         ", got " + DTypeName(t));
}

}  // namespace dispatch_detail

// fn(Tag<float>) for float32, fn(Tag<Bf16>) for bfloat16.
template <typename Bf16, typename Fn>
ffi::Error DispatchFloat(const char* kernel, const char* operand, ffi::DataType t, Fn&& fn) {
  switch (t) {
    case ffi::DataType::F32: return dispatch_detail::Invoke<float>(fn);
    case ffi::DataType::BF16: return dispatch_detail::Invoke<Bf16>(fn);
    default: return dispatch_detail::Unsupported(kernel, operand, "float32 or bfloat16", t);
  }
}

// fn(Tag<int32_t>) for int32, fn(Tag<int64_t>) for int64.
template <typename Fn>
ffi::Error DispatchId(const char* kernel, const char* operand, ffi::DataType t, Fn&& fn) {
  switch (t) {
    case ffi::DataType::S32: return dispatch_detail::Invoke<int32_t>(fn);
    case ffi::DataType::S64: return dispatch_detail::Invoke<int64_t>(fn);
    default: return dispatch_detail::Unsupported(kernel, operand, "int32 or int64", t);
  }
}

}  // namespace embark
