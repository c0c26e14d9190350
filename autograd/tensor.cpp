#include "autograd/tensor.h"

#include <cstring>
#include <iomanip>
#include <sstream>

#include "autograd/backend/dispatch.h"
#ifdef KVLAB_WITH_CUDA
#include "autograd/backend/cuda/runtime.h"
#endif

namespace kvlab {

std::string shape_str(const Shape& s) {
  std::string out = "(";
  for (size_t i = 0; i < s.size(); ++i) {
    if (i) out += ", ";
    out += std::to_string(s[i]);
  }
  return out + ")";
}

int64_t shape_numel(const Shape& s) {
  int64_t n = 1;
  for (int64_t d : s) n *= d;
  return n;
}

Shape contiguous_strides(const Shape& s) {
  Shape st(s.size());
  int64_t acc = 1;
  for (size_t i = s.size(); i-- > 0;) {
    st[i] = acc;
    acc *= s[i];
  }
  return st;
}

Storage::Storage(size_t nbytes, Device device) : nbytes_(nbytes), device_(device) {
  data_ = allocator_for(device).allocate(nbytes);
}

Storage::Storage(std::shared_ptr<void> owner, void* data, size_t nbytes)
    : data_(data), nbytes_(nbytes), device_(Device::CPU), owner_(std::move(owner)) {}

Storage::~Storage() {
  if (!owner_) allocator_for(device_).deallocate(data_, nbytes_);
}

const TensorImpl& Tensor::checked() const {
  KVLAB_CHECK(impl_ != nullptr, "tensor: use of an undefined tensor");
  return *impl_;
}

Tensor Tensor::empty(const Shape& shape, DType dtype, Device device) {
  for (int64_t d : shape)
    KVLAB_CHECK(d >= 0, "tensor: negative size in shape ", kvlab::shape_str(shape));
  check_device_available(device);
  auto impl = std::make_shared<TensorImpl>();
  const size_t n = static_cast<size_t>(shape_numel(shape));
  impl->storage = std::make_shared<Storage>(n * dtype_size(dtype), device);
  impl->sizes = shape;
  impl->strides = contiguous_strides(shape);
  impl->dtype = dtype;
  return Tensor(std::move(impl));
}

Tensor Tensor::adopt(std::vector<float>&& values, const Shape& shape) {
  KVLAB_CHECK(shape_numel(shape) == static_cast<int64_t>(values.size()),
              "tensor: adopt: ", values.size(), " values for shape ", kvlab::shape_str(shape));
  auto owner = std::make_shared<std::vector<float>>(std::move(values));
  auto impl = std::make_shared<TensorImpl>();
  impl->storage = std::make_shared<Storage>(owner, owner->data(), owner->size() * sizeof(float));
  impl->sizes = shape;
  impl->strides = contiguous_strides(shape);
  impl->dtype = DType::F32;
  return Tensor(std::move(impl));
}

Tensor Tensor::zeros(const Shape& shape, DType dtype, Device device) {
  Tensor t = empty(shape, dtype, device);
  const size_t nbytes = static_cast<size_t>(t.numel()) * dtype_size(dtype);
#ifdef KVLAB_WITH_CUDA
  if (device == Device::CUDA) {
    cuda::memset_zero(t.raw_data(), nbytes);
    return t;
  }
#endif
  std::memset(t.raw_data(), 0, nbytes);
  return t;
}

Tensor Tensor::full(const Shape& shape, double value, DType dtype, Device device) {
  Tensor t = empty(shape, dtype, device);
  t.fill(value);
  return t;
}

const Shape& Tensor::sizes() const { return checked().sizes; }
const Shape& Tensor::strides() const { return checked().strides; }
int64_t Tensor::numel() const { return shape_numel(checked().sizes); }
DType Tensor::dtype() const { return checked().dtype; }
Device Tensor::device() const { return checked().storage->device(); }
int64_t Tensor::offset() const { return checked().offset; }
const std::shared_ptr<Storage>& Tensor::storage() const { return checked().storage; }

int64_t Tensor::size(int d) const {
  const int n = dim();
  const int i = d < 0 ? d + n : d;
  KVLAB_CHECK(i >= 0 && i < n, "tensor: dim ", d, " out of range for shape ", shape_str());
  return sizes()[i];
}

int64_t Tensor::stride(int d) const {
  const int n = dim();
  const int i = d < 0 ? d + n : d;
  KVLAB_CHECK(i >= 0 && i < n, "tensor: dim ", d, " out of range for shape ", shape_str());
  return strides()[i];
}

bool Tensor::is_contiguous() const {
  const TensorImpl& t = checked();
  int64_t expect = 1;
  for (size_t i = t.sizes.size(); i-- > 0;) {
    if (t.sizes[i] != 1 && t.strides[i] != expect) return false;
    expect *= t.sizes[i];
  }
  return true;
}

void* Tensor::raw_data() const {
  const TensorImpl& t = checked();
  return static_cast<char*>(t.storage->data()) +
         t.offset * static_cast<int64_t>(dtype_size(t.dtype));
}

double Tensor::item() const {
  KVLAB_CHECK(numel() == 1, "item: tensor ", shape_str(), " has ", numel(), " elements, not 1");
  if (device() != Device::CPU) return to(Device::CPU).item();
  switch (dtype()) {
    case DType::F32:
      return *data<float>();
    case DType::F64:
      return *data<double>();
    case DType::I32:
      return *data<int32_t>();
    case DType::BF16:
    case DType::FP8:
    case DType::INT8:
    case DType::INT4:
      break;
  }
  KVLAB_CHECK(false, "item: ", dtype_name(dtype()), " tensors are storage, not readable as numbers");
  return 0;
}

Tensor Tensor::as_strided(const Shape& sizes, const Shape& strides, int64_t offset) const {
  const TensorImpl& t = checked();
  KVLAB_ASSERT(sizes.size() == strides.size());
  int64_t lo = offset, hi = offset;
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (sizes[i] == 0) {
      hi = lo - 1;
      break;
    }
    if (strides[i] >= 0)
      hi += (sizes[i] - 1) * strides[i];
    else
      lo += (sizes[i] - 1) * strides[i];
  }
  const int64_t cap = static_cast<int64_t>(t.storage->nbytes() / dtype_size(t.dtype));
  KVLAB_CHECK(hi < lo || (lo >= 0 && hi < cap), "view: ", kvlab::shape_str(sizes), " at offset ",
              offset, " exceeds the storage of ", cap, " elements");
  auto impl = std::make_shared<TensorImpl>();
  impl->storage = t.storage;
  impl->sizes = sizes;
  impl->strides = strides;
  impl->offset = offset;
  impl->dtype = t.dtype;
  return Tensor(std::move(impl));
}

void Tensor::copy_from(const Tensor& src) {
  KVLAB_CHECK(src.sizes() == sizes(), "copy: source ", src.shape_str(), " does not match ",
              shape_str());
  if (src.device() != device()) {
    // Across devices: a contiguous block of the source moves as bytes, then the copy (strides,
    // dtype) completes on this tensor's device.
    const Tensor packed = src.contiguous();
    Tensor moved = empty(src.sizes(), src.dtype(), device());
    const size_t nbytes = static_cast<size_t>(src.numel()) * dtype_size(src.dtype());
#ifdef KVLAB_WITH_CUDA
    if (device() == Device::CUDA)
      cuda::memcpy_to_device(moved.raw_data(), packed.raw_data(), nbytes);
    else
      cuda::memcpy_to_host(moved.raw_data(), packed.raw_data(), nbytes);
#else
    KVLAB_ASSERT(nbytes == 0, "a non-CPU tensor exists in a CPU-only build");
#endif
    copy_from(moved);
    return;
  }
  KVLAB_KERNEL(device(), strided_copy(raw_data(), dtype(), strides(), src.raw_data(), src.dtype(),
                                      src.strides(), sizes()));
}

Tensor Tensor::contiguous() const {
  if (is_contiguous()) return *this;
  return clone();
}

Tensor Tensor::clone() const {
  Tensor out = empty(sizes(), dtype(), device());
  out.copy_from(*this);
  return out;
}

Tensor Tensor::to(DType dt) const {
  if (dt == dtype()) return *this;
  Tensor out = empty(sizes(), dt, device());
  out.copy_from(*this);
  return out;
}

Tensor Tensor::to(Device d) const {
  if (d == device()) return *this;
  Tensor out = empty(sizes(), dtype(), d);
  out.copy_from(*this);
  return out;
}

void Tensor::move_to(Device d) {
  if (d == device()) return;
  const Tensor moved = to(d);
  impl_->storage = moved.storage();
  impl_->strides = moved.strides();
  impl_->offset = 0;
  if (impl_->grad.defined()) impl_->grad = impl_->grad.to(d);
}

void Tensor::share_data_of(const Tensor& src) {
  KVLAB_CHECK(src.sizes() == sizes() && src.dtype() == dtype() && src.device() == device() &&
                  src.is_contiguous(),
              "tensor: share_data_of needs a contiguous ", shape_str(), " ", dtype_name(dtype()),
              " tensor on the same device, not ", src.shape_str(), " ", dtype_name(src.dtype()));
  impl_->storage = src.storage();
  impl_->strides = src.strides();
  impl_->offset = src.offset();
}

void Tensor::fill(double value) {
  Tensor src = empty({}, DType::F64);
  *src.data<double>() = value;
  const Tensor value_here = src.to(device());
  const Shape zero(sizes().size(), 0);
  KVLAB_KERNEL(device(), strided_copy(raw_data(), dtype(), strides(), value_here.raw_data(),
                                      DType::F64, zero, sizes()));
}

bool Tensor::requires_grad() const { return checked().requires_grad; }

Tensor& Tensor::set_requires_grad(bool on) {
  KVLAB_CHECK(!on || dtype() == DType::F32 || dtype() == DType::F64,
              "requires_grad: only floating tensors can require grad, not ", dtype_name(dtype()));
  impl_->requires_grad = on;
  return *this;
}

Tensor Tensor::grad() const { return checked().grad; }
void Tensor::set_grad(const Tensor& g) { impl_->grad = g; }
void Tensor::zero_grad() { impl_->grad = Tensor(); }

Tensor Tensor::detach() const {
  const TensorImpl& t = checked();
  auto impl = std::make_shared<TensorImpl>();
  impl->storage = t.storage;
  impl->sizes = t.sizes;
  impl->strides = t.strides;
  impl->offset = t.offset;
  impl->dtype = t.dtype;
  return Tensor(std::move(impl));
}

const std::shared_ptr<Node>& Tensor::grad_fn() const { return checked().grad_fn; }
void Tensor::set_grad_fn(std::shared_ptr<Node> fn) { impl_->grad_fn = std::move(fn); }

std::string Tensor::str(int max_elems) const {
  if (!defined()) return "Tensor(undefined)";
  std::ostringstream os;
  os << "Tensor(shape=" << shape_str() << ", dtype=" << dtype_name(dtype())
     << ", device=" << device_name(device());
  if (requires_grad()) os << ", requires_grad";
  if (dtype() != DType::BF16) {
    std::vector<double> v = to_vector<double>();
    os << ", values=[" << std::setprecision(6);
    for (size_t i = 0; i < v.size() && static_cast<int>(i) < max_elems; ++i)
      os << (i ? ", " : "") << v[i];
    if (static_cast<int>(v.size()) > max_elems) os << ", ...";
    os << "]";
  }
  os << ")";
  return os.str();
}

std::ostream& operator<<(std::ostream& os, const Tensor& t) { return os << t.str(); }

}  // namespace kvlab
