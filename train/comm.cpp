#include "train/comm.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <mutex>

#include "platform/error.h"

namespace kvlab {

#ifdef KVLAB_HAVE_MPI
// comm_mpi.cpp
std::shared_ptr<Communicator> make_mpi_world_communicator(double timeout_s);
#endif

namespace {

class LocalCommunicator final : public Communicator {
 public:
  int rank() const override { return 0; }
  int world_size() const override { return 1; }
  int local_rank() const override { return 0; }
  std::string backend() const override { return "local"; }
  double timeout_s() const override { return 0; }
  using Communicator::allreduce_mean;
  void allreduce_mean(std::span<float>, std::string_view) override {}
  void allreduce_sum(std::span<double>, std::string_view) override {}
  void broadcast(std::span<std::byte>, int root, std::string_view what) override {
    KVLAB_CHECK(root == 0, what, ": root rank ", root, " does not exist (1 rank)");
  }
  std::vector<uint64_t> gather(std::span<const uint64_t> mine, int root,
                               std::string_view what) override {
    KVLAB_CHECK(root == 0, what, ": root rank ", root, " does not exist (1 rank)");
    return {mine.begin(), mine.end()};
  }
  void allgatherv(std::span<const float> mine, std::span<float> out,
                  std::span<const int64_t> counts, std::string_view what) override {
    KVLAB_CHECK(counts.size() == 1 && counts[0] == static_cast<int64_t>(mine.size()) &&
                    out.size() == mine.size(),
                what, ": counts do not match the buffers");
    std::copy(mine.begin(), mine.end(), out.begin());
  }
  void gatherv(std::span<const float> mine, std::span<float> out, std::span<const int64_t> counts,
               int root, std::string_view what) override {
    KVLAB_CHECK(root == 0, what, ": root rank ", root, " does not exist (1 rank)");
    allgatherv(mine, out, counts, what);
  }
  void barrier(std::string_view) override {}
  std::shared_ptr<Communicator> split(int, std::string_view) override;
};

const char* env(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? v : nullptr;
}

}  // namespace

std::shared_ptr<Communicator> local_communicator() {
  static const std::shared_ptr<Communicator> local = std::make_shared<LocalCommunicator>();
  return local;
}

std::shared_ptr<Communicator> LocalCommunicator::split(int, std::string_view) {
  return local_communicator();
}

bool launched_by_mpi() {
  for (const char* name : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMI_RANK", "PMIX_RANK"})
    if (env(name) != nullptr) return true;
  return false;
}

int launcher_world_size() {
  for (const char* name : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE"})
    if (const char* v = env(name)) return std::max(1, std::atoi(v));
  return 1;
}

std::shared_ptr<Communicator> world_communicator(double timeout_s) {
  KVLAB_CHECK(timeout_s > 0, "comm: the collective timeout must be > 0 s, got ", timeout_s);
  if (!launched_by_mpi()) return local_communicator();
#ifdef KVLAB_HAVE_MPI
  static std::mutex mu;
  static std::shared_ptr<Communicator> world;
  std::lock_guard<std::mutex> lock(mu);
  if (!world) world = make_mpi_world_communicator(timeout_s);
  return world;
#else
  const int n = launcher_world_size();
  KVLAB_CHECK(n <= 1,
              "this kvlab was built without MPI (KVLAB_MPI=OFF or libopenmpi-dev missing) "
              "but mpirun started ",
              n,
              " ranks: each would train its own copy; rebuild with "
              "MPI or run without mpirun");
  return local_communicator();
#endif
}

void Communicator::allreduce_mean(const Tensor& flat, std::string_view what) {
  KVLAB_CHECK(flat.dtype() == DType::F32 && flat.is_contiguous(), what,
              ": all-reduce needs a contiguous f32 buffer");
  KVLAB_CHECK(flat.device() == Device::CPU, what, ": the ", backend(),
              " communicator reduces host memory only; GPU ranks need a build with CUDA, NCCL "
              "and MPI");
  allreduce_mean(std::span<float>(flat.data<float>(), static_cast<size_t>(flat.numel())), what);
}

GradientReducer::GradientReducer(size_t bucket_bytes)
    : bucket_elems_(std::max<size_t>(1, bucket_bytes / sizeof(float))) {}

void GradientReducer::allreduce_mean(Communicator& comm, const NamedTensors& params) {
  buckets_ = 0;
  if (comm.world_size() == 1) return;
  std::vector<Tensor> pieces;  // each gradient as a flat contiguous (n) view
  int64_t total = 0;
  for (const auto& [name, p] : params) {
    Tensor g = p.grad();
    if (!g.defined()) continue;
    KVLAB_CHECK(g.dtype() == DType::F32, "all-reduce: gradient of ", name, " is not f32");
    KVLAB_CHECK(pieces.empty() || g.device() == pieces[0].device(), "all-reduce: gradient of ",
                name, " is on ", device_name(g.device()), ", the others on ",
                device_name(pieces[0].device()));
    if (!g.is_contiguous()) {
      g = g.contiguous();
      Tensor handle = p;
      handle.set_grad(g);
    }
    pieces.push_back(g.as_strided({g.numel()}, {1}, g.offset()));
    total += g.numel();
  }
  if (total == 0) return;
  const int64_t cap = static_cast<int64_t>(bucket_elems_);
  const int64_t size = std::min(cap, total);
  if (!buffer_.defined() || buffer_.numel() < size || buffer_.device() != pieces[0].device())
    buffer_ = Tensor::empty({size}, DType::F32, pieces[0].device());
  // (offset, length) slices of a flat tensor
  auto slice = [](const Tensor& t, int64_t at, int64_t n) {
    return t.as_strided({n}, {1}, t.offset() + at);
  };
  const int64_t n_buckets = (total + cap - 1) / cap;
  // Visits `count` flat elements starting at piece `pi`, offset `off`, as (piece ptr, buffer
  // position, length) runs; leaves (pi, off) just after them.
  auto walk = [&](size_t& pi, int64_t& off, int64_t count, auto&& fn) {
    int64_t pos = 0;
    while (pos < count) {
      const int64_t take = std::min(count - pos, pieces[pi].numel() - off);
      fn(slice(pieces[pi], off, take), pos, take);
      pos += take;
      off += take;
      if (off == pieces[pi].numel()) {
        ++pi;
        off = 0;
      }
    }
  };
  size_t pi = 0;
  int64_t off = 0;
  for (int64_t b = 0, start = 0; b < n_buckets; ++b, start += cap) {
    const int64_t count = std::min(cap, total - start);
    size_t pi_in = pi;
    int64_t off_in = off;
    walk(pi_in, off_in, count,
         [&](const Tensor& src, int64_t pos, int64_t n) { slice(buffer_, pos, n).copy_from(src); });
    const std::string what = n_buckets == 1 ? std::string("all-reduce of gradients")
                                            : detail::cat("all-reduce of gradients (bucket ", b + 1,
                                                          " of ", n_buckets, ")");
    comm.allreduce_mean(slice(buffer_, 0, count), what);
    walk(pi, off, count, [&](const Tensor& dst, int64_t pos, int64_t n) {
      Tensor d = dst;
      d.copy_from(slice(buffer_, pos, n));
    });
    ++buckets_;
  }
}

bool same_on_all_ranks(Communicator& comm, uint64_t value, std::string_view what) {
  if (comm.world_size() == 1) return true;
  uint64_t root_value = value;
  comm.broadcast(std::as_writable_bytes(std::span<uint64_t>(&root_value, 1)), 0, what);
  double mismatches = root_value == value ? 0.0 : 1.0;
  comm.allreduce_sum(std::span<double>(&mismatches, 1), what);
  return mismatches == 0.0;
}

uint64_t hash_bytes(const void* data, size_t n, uint64_t h) {
  const auto* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < n; ++i) {
    h ^= p[i];
    h *= 0x100000001b3ull;
  }
  return h;
}

}  // namespace kvlab
