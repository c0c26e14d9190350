#pragma once
// Tensor: a cheap handle (shared pointer) over shared, device-tagged Storage, with sizes,
// strides in elements, an offset and a dtype. Row-major, PyTorch order.
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "autograd/backend/allocator.h"
#include "autograd/backend/device.h"
#include "platform/error.h"

namespace kvlab {

using Shape = std::vector<int64_t>;

std::string shape_str(const Shape& s);  // "(4, 8)"
int64_t shape_numel(const Shape& s);
Shape contiguous_strides(const Shape& s);

class Storage {
 public:
  Storage(size_t nbytes, Device device);
  // Host memory that `owner` keeps alive (and frees), not the allocator's.
  Storage(std::shared_ptr<void> owner, void* data, size_t nbytes);
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;
  void* data() const { return data_; }
  size_t nbytes() const { return nbytes_; }
  Device device() const { return device_; }

 private:
  void* data_ = nullptr;
  size_t nbytes_ = 0;
  Device device_;
  std::shared_ptr<void> owner_;
};

struct Node;
struct TensorImpl;
class Tensor;

template <class T>
constexpr DType dtype_of();
template <>
constexpr DType dtype_of<float>() {
  return DType::F32;
}
template <>
constexpr DType dtype_of<double>() {
  return DType::F64;
}
template <>
constexpr DType dtype_of<int32_t>() {
  return DType::I32;
}

class Tensor {
 public:
  Tensor() = default;
  explicit Tensor(std::shared_ptr<TensorImpl> impl) : impl_(std::move(impl)) {}

  // --- creation (contents of empty() are uninitialised) ---
  static Tensor empty(const Shape& shape, DType dtype = DType::F32, Device device = Device::CPU);
  static Tensor zeros(const Shape& shape, DType dtype = DType::F32, Device device = Device::CPU);
  static Tensor full(const Shape& shape, double value, DType dtype = DType::F32,
                     Device device = Device::CPU);
  template <class T>
  static Tensor from_vector(const std::vector<T>& values, const Shape& shape);
  static Tensor scalar(double value, DType dtype = DType::F32) { return full({}, value, dtype); }
  // A CPU f32 tensor over values' own buffer, which it keeps: no copy.
  static Tensor adopt(std::vector<float>&& values, const Shape& shape);

  // --- metadata ---
  bool defined() const { return impl_ != nullptr; }
  const Shape& sizes() const;
  const Shape& strides() const;
  int64_t size(int dim) const;  // negative dims count from the end
  int64_t stride(int dim) const;
  int dim() const { return static_cast<int>(sizes().size()); }
  int64_t numel() const;
  DType dtype() const;
  Device device() const;
  int64_t offset() const;
  bool is_contiguous() const;
  std::string shape_str() const { return kvlab::shape_str(sizes()); }
  const std::shared_ptr<Storage>& storage() const;

  // --- data access ---
  template <class T>
  T* data() const;  // pointer to element 0 of this view, in the memory of its device; checks dtype
  void* raw_data() const;
  template <class T>
  std::vector<T> to_vector() const;  // contiguous host copy in logical order
  double item() const;               // value of a one-element tensor, as double (any device)

  // --- copies and views (no graph: differentiable versions live in ops/) ---
  Tensor contiguous() const;  // self if already contiguous
  Tensor clone() const;       // always a fresh contiguous copy
  Tensor to(DType dtype) const;
  Tensor to(Device device) const;  // self when already there
  // Moves this tensor's data to `device` in place (a contiguous copy): every handle sharing
  // this tensor sees the moved data. For parameters; views of the old storage keep it.
  void move_to(Device device);
  // This tensor's data becomes src's (same shape, dtype and device; src contiguous), in place,
  // as move_to does: every handle sharing this tensor sees it. Loads parameters without a copy.
  void share_data_of(const Tensor& src);
  // View with new metadata over the same storage (no check beyond bounds).
  Tensor as_strided(const Shape& sizes, const Shape& strides, int64_t offset) const;
  void copy_from(const Tensor& src);  // same shape; any strides and devices; dtype converted
  void fill(double value);

  // --- autograd ---
  bool requires_grad() const;
  Tensor& set_requires_grad(bool on = true);
  Tensor grad() const;  // undefined until a backward reaches this leaf
  void set_grad(const Tensor& g);
  void zero_grad();       // drops the gradient (the next backward writes a fresh one)
  Tensor detach() const;  // same storage, no history
  const std::shared_ptr<Node>& grad_fn() const;
  void set_grad_fn(std::shared_ptr<Node> fn);
  // Backward from a scalar (grad = 1) or from `grad` of this tensor's shape. The graph is
  // released afterwards unless keep_graph.
  void backward(const Tensor& grad = Tensor(), bool keep_graph = false) const;

  std::string str(int max_elems = 16) const;
  TensorImpl* impl() const { return impl_.get(); }
  const std::shared_ptr<TensorImpl>& impl_ptr() const { return impl_; }
  bool same(const Tensor& other) const { return impl_ == other.impl_; }

 private:
  const TensorImpl& checked() const;
  std::shared_ptr<TensorImpl> impl_;
};

struct TensorImpl {
  std::shared_ptr<Storage> storage;
  Shape sizes;
  Shape strides;
  int64_t offset = 0;
  DType dtype = DType::F32;
  bool requires_grad = false;
  Tensor grad;
  std::shared_ptr<Node> grad_fn;
};

std::ostream& operator<<(std::ostream& os, const Tensor& t);

// Applies `f(T{})` for the floating dtype of `t` (f32 or f64); anything else is an error that
// names the op.
template <class F>
decltype(auto) dispatch_float(DType dtype, const char* op, F&& f) {
  switch (dtype) {
    case DType::F32:
      return f(float{});
    case DType::F64:
      return f(double{});
    default:
      break;
  }
  KVLAB_CHECK(false, op, ": dtype ", dtype_name(dtype), " is not supported (f32 or f64 expected)");
  return f(float{});  // unreachable
}

// ---- template definitions ----
template <class T>
T* Tensor::data() const {
  const TensorImpl& t = checked();
  KVLAB_CHECK(t.dtype == dtype_of<T>(), "tensor data: dtype is ", dtype_name(t.dtype),
              ", accessed as ", dtype_name(dtype_of<T>()));
  return static_cast<T*>(t.storage->data()) + t.offset;
}

template <class T>
Tensor Tensor::from_vector(const std::vector<T>& values, const Shape& shape) {
  KVLAB_CHECK(static_cast<int64_t>(values.size()) == shape_numel(shape),
              "from_vector: ", values.size(), " values for shape ", kvlab::shape_str(shape));
  Tensor t = empty(shape, dtype_of<T>());
  std::copy(values.begin(), values.end(), t.data<T>());
  return t;
}

template <class T>
std::vector<T> Tensor::to_vector() const {
  Tensor c = contiguous();
  if (c.device() != Device::CPU) c = c.to(Device::CPU);
  if (c.dtype() != dtype_of<T>()) c = c.to(dtype_of<T>());
  const T* p = c.data<T>();
  return std::vector<T>(p, p + c.numel());
}

}  // namespace kvlab
