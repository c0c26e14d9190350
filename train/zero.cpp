#include "train/zero.h"

#include <algorithm>
#include <chrono>
#include <cmath>

#include "autograd/backend/dispatch.h"
#include "checkpoints/model_io.h"
#include "platform/error.h"

namespace kvlab {

namespace {
int64_t overlap(int64_t a0, int64_t a1, int64_t b0, int64_t b1) {
  return std::max<int64_t>(0, std::min(a1, b1) - std::max(a0, b0));
}
}  // namespace

ShardedAdamW::ShardedAdamW(NamedTensors params, const AdamWConfig& cfg,
                           std::shared_ptr<Communicator> comm, size_t bucket_bytes)
    : params_(std::move(params)),
      cfg_(cfg),
      comm_(std::move(comm)),
      bucket_elems_(static_cast<int64_t>(std::max<size_t>(1, bucket_bytes / sizeof(float)))) {
  offsets_.push_back(0);
  for (auto& [name, p] : params_) {
    KVLAB_CHECK(p.dtype() == DType::F32 && p.is_contiguous(), "zero: parameter ", name,
                " must be a contiguous f32 tensor");
    offsets_.push_back(offsets_.back() + p.numel());
  }
  const int64_t n = offsets_.back(), w = comm_->world_size();
  for (int64_t r = 0; r <= w; ++r) bounds_.push_back(n * r / w);
  const Device dev = device_of(params_);
  m_ = Tensor::zeros({shard_end() - shard_begin()}, DType::F32, dev);
  v_ = Tensor::zeros({shard_end() - shard_begin()}, DType::F32, dev);
  const int64_t bucket = std::min(bucket_elems_, n);
  send_ = Tensor::empty({bucket}, DType::F32, Device::CPU);
  recv_ = Tensor::empty({bucket}, DType::F32, Device::CPU);
}

template <class F>
void ShardedAdamW::for_range(int64_t begin, int64_t end, F&& fn) const {
  if (begin >= end) return;
  size_t i = static_cast<size_t>(std::upper_bound(offsets_.begin(), offsets_.end(), begin) -
                                 offsets_.begin()) -
             1;
  for (int64_t pos = begin; pos < end; ++i) {
    const int64_t off = pos - offsets_[i];
    const int64_t n = std::min(end, offsets_[i + 1]) - pos;
    if (n > 0) fn(i, off, pos, n);
    pos += n;
  }
}

Tensor ShardedAdamW::flat(size_t i, int64_t off, int64_t n) const {
  const Tensor& p = params_[i].second;
  return p.as_strided({n}, {1}, p.offset() + off);
}

double ShardedAdamW::step(double lr, double grad_scale) {
  ++step_;
  const Device dev = device_of(params_);
  m_.move_to(dev);  // the model may have moved after the optimizer was made
  v_.move_to(dev);
  // The shard's runs, one per parameter it overlaps, in one multi-tensor update as AdamW's.
  const int64_t s0 = shard_begin();
  std::vector<Tensor> grads;  // keeps contiguous copies alive until the update ran
  std::vector<AdamWTensor> runs;
  for_range(s0, shard_end(), [&](size_t i, int64_t off, int64_t pos, int64_t n) {
    Tensor& p = params_[i].second;
    const Tensor g = p.grad();
    if (!g.defined()) return;
    grads.push_back(g.contiguous());
    KVLAB_CHECK(grads.back().device() == dev, "zero: gradient of ", params_[i].first, " is on ",
                device_name(grads.back().device()), ", the parameter on ", device_name(dev));
    const int64_t local = pos - s0;
    runs.push_back({p.data<float>() + off, grads.back().data<float>() + off,
                    m_.data<float>() + local, v_.data<float>() + local, n,
                    adamw_step(cfg_, step_, lr, grad_scale, p.dim())});
  });
  KVLAB_KERNEL(dev, adamw_update_many(runs));
  // All-gather the parameters, bucket by bucket: in flat order, rank r's part of a bucket is
  // its shard's overlap with it, so the concatenation in rank order is the bucket itself.
  const auto t0 = std::chrono::steady_clock::now();
  const int64_t total = numel(), w = comm_->world_size();
  std::vector<int64_t> counts(static_cast<size_t>(w));
  const int64_t n_buckets = (total + bucket_elems_ - 1) / bucket_elems_;
  for (int64_t b = 0, c0 = 0; c0 < total; ++b, c0 += bucket_elems_) {
    const int64_t c1 = std::min(total, c0 + bucket_elems_);
    for (int64_t r = 0; r < w; ++r)
      counts[static_cast<size_t>(r)] =
          overlap(bounds_[static_cast<size_t>(r)], bounds_[static_cast<size_t>(r) + 1], c0, c1);
    const int64_t m0 = std::max(c0, shard_begin()), m1 = std::min(c1, shard_end());
    // Through host buffers: the communicator reduces host memory. copy_from crosses devices.
    for_range(m0, m1, [&](size_t i, int64_t off, int64_t pos, int64_t n) {
      send_.as_strided({n}, {1}, pos - m0).copy_from(flat(i, off, n));
    });
    comm_->allgatherv(std::span<const float>(send_.data<float>(),
                                             static_cast<size_t>(std::max<int64_t>(0, m1 - m0))),
                      std::span<float>(recv_.data<float>(), static_cast<size_t>(c1 - c0)), counts,
                      n_buckets == 1 ? std::string("all-gather of parameters (zero 1)")
                                     : detail::cat("all-gather of parameters (zero 1, bucket ",
                                                   b + 1, " of ", n_buckets, ")"));
    for_range(c0, c1, [&](size_t i, int64_t off, int64_t pos, int64_t n) {
      flat(i, off, n).copy_from(recv_.as_strided({n}, {1}, pos - c0));
    });
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void ShardedAdamW::gather_moments(NamedArrays& m, NamedArrays& v) {
  const bool root = comm_->rank() == 0;
  const int64_t total = numel(), w = comm_->world_size();
  std::vector<float> full_m(root ? static_cast<size_t>(total) : 0), full_v(full_m.size());
  std::vector<int64_t> counts(static_cast<size_t>(w));
  const Tensor host_m = m_.to(Device::CPU), host_v = v_.to(Device::CPU);  // the shard's moments
  const std::span<const float> my_m(host_m.data<float>(), static_cast<size_t>(host_m.numel()));
  const std::span<const float> my_v(host_v.data<float>(), static_cast<size_t>(host_v.numel()));
  for (int64_t c0 = 0; c0 < total; c0 += bucket_elems_) {
    const int64_t c1 = std::min(total, c0 + bucket_elems_);
    for (int64_t r = 0; r < w; ++r)
      counts[static_cast<size_t>(r)] =
          overlap(bounds_[static_cast<size_t>(r)], bounds_[static_cast<size_t>(r) + 1], c0, c1);
    const int64_t m0 = std::max(c0, shard_begin()), m1 = std::min(c1, shard_end());
    const size_t local = static_cast<size_t>(std::max<int64_t>(0, m0 - shard_begin()));
    const size_t n = static_cast<size_t>(std::max<int64_t>(0, m1 - m0));
    const size_t out0 = root ? static_cast<size_t>(c0) : 0;
    const size_t out_n = root ? static_cast<size_t>(c1 - c0) : 0;
    comm_->gatherv(my_m.subspan(local, n),
                   std::span<float>(full_m).subspan(out0, out_n), counts, 0,
                   "gather of AdamW first moments (zero 1)");
    comm_->gatherv(my_v.subspan(local, n),
                   std::span<float>(full_v).subspan(out0, out_n), counts, 0,
                   "gather of AdamW second moments (zero 1)");
  }
  if (!root) return;
  m.clear();
  v.clear();
  for (size_t i = 0; i < params_.size(); ++i) {
    const auto& [name, p] = params_[i];
    const auto a = full_m.begin() + offsets_[i], b = full_m.begin() + offsets_[i + 1];
    m.emplace_back(name, ArrayF32{p.sizes(), std::vector<float>(a, b)});
    v.emplace_back(name, ArrayF32{p.sizes(), std::vector<float>(full_v.begin() + offsets_[i],
                                                                full_v.begin() + offsets_[i + 1])});
  }
}

void ShardedAdamW::load_moments(const NamedArrays& m, const NamedArrays& v, int64_t step,
                                const std::filesystem::path& file) {
  check_arrays_fit(params_, m, "optimizer/m", file);
  check_arrays_fit(params_, v, "optimizer/v", file);
  // Filled on the host: in place where the moments live there, else copied to their device.
  Tensor host_m = m_.to(Device::CPU), host_v = v_.to(Device::CPU);
  const int64_t s0 = shard_begin();
  for_range(s0, shard_end(), [&](size_t i, int64_t off, int64_t pos, int64_t n) {
    const int64_t local = pos - s0;
    std::copy_n(m[i].second.data.begin() + off, n, host_m.data<float>() + local);
    std::copy_n(v[i].second.data.begin() + off, n, host_v.data<float>() + local);
  });
  if (m_.device() != Device::CPU) {
    m_.copy_from(host_m);
    v_.copy_from(host_v);
  }
  step_ = step;
}

}  // namespace kvlab
