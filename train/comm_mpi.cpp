// The MPI communicator (compiled only when KVLAB_HAVE_MPI). Every collective is non-blocking
// (MPI_Iallreduce, ...) and polled with MPI_Test until it completes or the timeout passes; on a
// timeout the rank asks every other rank, on a second communicator, which collective it is in,
// and names those that do not answer. Errors come back as codes (MPI_ERRORS_RETURN) and are
// turned into kvlab::Error naming the rank.
// The C API only (OpenMPI's mpi.h would pull in the deprecated C++ bindings otherwise).
#define OMPI_SKIP_MPICXX 1
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdio>
#include <thread>

#include "platform/error.h"
#include "train/comm.h"
#ifdef KVLAB_WITH_NCCL
#include "autograd/backend/collectives.h"
#endif

namespace kvlab {

namespace {

using Clock = std::chrono::steady_clock;

constexpr int kAskTag = 7101;    // "which collective are you in?" (payload: the asker's count)
constexpr int kReplyTag = 7102;  // the answer: the replier's collective count

// Whether the job must be aborted at exit (a collective failed or timed out, or fail()).
bool g_failed = false;

// Initialises MPI on construction; at exit, finalises it, or aborts the job after a failure
// (a rank that failed while the others wait in a collective would otherwise hang them).
struct MpiLifetime {
  MpiLifetime() {
    int initialized = 0;
    MPI_Initialized(&initialized);
    if (!initialized) {
      int provided = 0;
      // Only the main thread calls MPI (OpenMP threads never do).
      const int rc = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided);
      KVLAB_CHECK(rc == MPI_SUCCESS, "MPI_Init_thread failed (code ", rc, ")");
      owned = true;
    }
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  }
  ~MpiLifetime() {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (finalized || !owned) return;
    if (g_failed) {
      std::fflush(stdout);
      std::fflush(stderr);
      MPI_Abort(MPI_COMM_WORLD, 1);
    }
    MPI_Finalize();
  }
  bool owned = false;
};

std::string error_string(int rc) {
  char buf[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(rc, buf, &len) != MPI_SUCCESS) return detail::cat("MPI error ", rc);
  return std::string(buf, static_cast<size_t>(len));
}

class MpiCommunicator final : public Communicator {
 public:
  explicit MpiCommunicator(double timeout_s) : timeout_(timeout_s) {
    check(MPI_Comm_dup(MPI_COMM_WORLD, &comm_), "MPI_Comm_dup");
    check(MPI_Comm_dup(MPI_COMM_WORLD, &ctrl_), "MPI_Comm_dup");
    set_up();
  }
  // The ranks of `parent` with the same color (collective over parent).
  MpiCommunicator(const MpiCommunicator& parent, int color, std::string_view what)
      : timeout_(parent.timeout_) {
    check(MPI_Comm_split(parent.comm_, color, parent.rank_, &comm_), what);
    check(MPI_Comm_split(parent.ctrl_, color, parent.rank_, &ctrl_), what);
    set_up();
  }

  std::shared_ptr<Communicator> split(int color, std::string_view what) override {
    return std::make_shared<MpiCommunicator>(*this, color, what);
  }

  int rank() const override { return rank_; }
  int world_size() const override { return size_; }
  int local_rank() const override { return local_rank_; }
  std::string backend() const override { return "mpi"; }
  double timeout_s() const override { return timeout_; }
  void fail() override { g_failed = true; }

 private:
  void set_up() {
    MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
    MPI_Comm_set_errhandler(ctrl_, MPI_ERRORS_RETURN);
    check(MPI_Comm_rank(comm_, &rank_), "MPI_Comm_rank");
    check(MPI_Comm_size(comm_, &size_), "MPI_Comm_size");
    MPI_Comm node;
    check(MPI_Comm_split_type(comm_, MPI_COMM_TYPE_SHARED, rank_, MPI_INFO_NULL, &node),
          "MPI_Comm_split_type");
    check(MPI_Comm_rank(node, &local_rank_), "MPI_Comm_rank");
    MPI_Comm_free(&node);
    reply_buf_.assign(static_cast<size_t>(size_), 0);
  }

 public:

  using Communicator::allreduce_mean;
#ifdef KVLAB_WITH_NCCL
  // GPU buffers: NCCL, its group set up on first use with the unique id broadcast over MPI.
  void allreduce_mean(const Tensor& flat, std::string_view what) override {
    if (flat.device() == Device::CPU) return Communicator::allreduce_mean(flat, what);
    KVLAB_CHECK(flat.dtype() == DType::F32 && flat.is_contiguous(), what,
                ": all-reduce needs a contiguous f32 buffer");
    if (!nccl_) {
      DeviceGroupId id{};
      if (rank_ == 0) id = device_group_id();
      broadcast(std::as_writable_bytes(std::span<char>(id)), 0, "broadcast of the NCCL id");
      nccl_ = std::make_unique<DeviceGroup>(size_, rank_, id, timeout_);
    }
    try {
      nccl_->allreduce_mean(flat.data<float>(), flat.numel(), what);
    } catch (const Error& e) {
      g_failed = true;
      KVLAB_CHECK(false, "rank ", rank_, ": ", e.what());
    }
  }
#endif

  void allreduce_mean(std::span<float> data, std::string_view what) override {
    MPI_Request req;
    check(MPI_Iallreduce(MPI_IN_PLACE, data.data(), count(data.size(), what), MPI_FLOAT, MPI_SUM,
                         comm_, &req),
          what);
    wait(req, what);
    const float inv = 1.0f / static_cast<float>(size_);
    for (float& x : data) x *= inv;
  }
  void allreduce_sum(std::span<double> data, std::string_view what) override {
    MPI_Request req;
    check(MPI_Iallreduce(MPI_IN_PLACE, data.data(), count(data.size(), what), MPI_DOUBLE, MPI_SUM,
                         comm_, &req),
          what);
    wait(req, what);
  }
  void broadcast(std::span<std::byte> data, int root, std::string_view what) override {
    check_root(root, what);
    MPI_Request req;
    check(MPI_Ibcast(data.data(), count(data.size(), what), MPI_BYTE, root, comm_, &req), what);
    wait(req, what);
  }
  std::vector<uint64_t> gather(std::span<const uint64_t> mine, int root,
                               std::string_view what) override {
    check_root(root, what);
    std::vector<uint64_t> all(rank_ == root ? mine.size() * static_cast<size_t>(size_) : 0);
    MPI_Request req;
    const int n = count(mine.size(), what);
    check(MPI_Igather(mine.data(), n, MPI_UINT64_T, all.data(), n, MPI_UINT64_T, root, comm_, &req),
          what);
    wait(req, what);
    return all;
  }
  void allgatherv(std::span<const float> mine, std::span<float> out,
                  std::span<const int64_t> counts, std::string_view what) override {
    std::vector<int> c, d;
    layout(mine, out, counts, true, what, c, d);
    MPI_Request req;
    check(MPI_Iallgatherv(mine.data(), c[static_cast<size_t>(rank_)], MPI_FLOAT, out.data(),
                          c.data(), d.data(), MPI_FLOAT, comm_, &req),
          what);
    wait(req, what);
  }
  void gatherv(std::span<const float> mine, std::span<float> out, std::span<const int64_t> counts,
               int root, std::string_view what) override {
    check_root(root, what);
    std::vector<int> c, d;
    layout(mine, out, counts, rank_ == root, what, c, d);
    MPI_Request req;
    check(MPI_Igatherv(mine.data(), c[static_cast<size_t>(rank_)], MPI_FLOAT, out.data(), c.data(),
                       d.data(), MPI_FLOAT, root, comm_, &req),
          what);
    wait(req, what);
  }
  void barrier(std::string_view what) override {
    MPI_Request req;
    check(MPI_Ibarrier(comm_, &req), what);
    wait(req, what);
  }

 private:
#ifdef KVLAB_WITH_NCCL
  std::unique_ptr<DeviceGroup> nccl_;
#endif
  void check(int rc, std::string_view what) {
    if (rc == MPI_SUCCESS) return;
    g_failed = true;
    KVLAB_CHECK(false, "rank ", rank_, ": ", what, " failed: ", error_string(rc));
  }
  void check_root(int root, std::string_view what) const {
    KVLAB_CHECK(root >= 0 && root < size_, what, ": root rank ", root, " does not exist (", size_,
                " ranks)");
  }
  int count(size_t n, std::string_view what) const {
    KVLAB_CHECK(n <= static_cast<size_t>(INT_MAX), what, ": ", n,
                " elements in one MPI call (at most INT_MAX)");
    return static_cast<int>(n);
  }
  void layout(std::span<const float> mine, std::span<float> out, std::span<const int64_t> counts,
              bool receiver, std::string_view what, std::vector<int>& c, std::vector<int>& d) {
    KVLAB_CHECK(counts.size() == static_cast<size_t>(size_), what, ": ", counts.size(),
                " counts for ", size_, " ranks");
    KVLAB_CHECK(counts[static_cast<size_t>(rank_)] == static_cast<int64_t>(mine.size()), what,
                ": rank ", rank_, " sends ", mine.size(), " values, counts say ",
                counts[static_cast<size_t>(rank_)]);
    int64_t total = 0;
    for (int64_t n : counts) {
      d.push_back(count(static_cast<size_t>(total), what));
      c.push_back(count(static_cast<size_t>(n), what));
      total += n;
    }
    KVLAB_CHECK(!receiver || static_cast<int64_t>(out.size()) == total, what, ": output holds ",
                out.size(), " values, the ranks send ", total);
  }

  // Answers every pending "which collective are you in?" from other ranks.
  void serve_asks() {
    for (;;) {
      int flag = 0;
      MPI_Status st;
      if (MPI_Iprobe(MPI_ANY_SOURCE, kAskTag, ctrl_, &flag, &st) != MPI_SUCCESS || !flag) return;
      int64_t theirs = 0;
      if (MPI_Recv(&theirs, 1, MPI_INT64_T, st.MPI_SOURCE, kAskTag, ctrl_, MPI_STATUS_IGNORE) !=
          MPI_SUCCESS)
        return;
      reply_buf_[static_cast<size_t>(st.MPI_SOURCE)] = seq_;
      MPI_Request r;
      if (MPI_Isend(&reply_buf_[static_cast<size_t>(st.MPI_SOURCE)], 1, MPI_INT64_T, st.MPI_SOURCE,
                    kReplyTag, ctrl_, &r) == MPI_SUCCESS)
        MPI_Request_free(&r);
    }
  }

  // Polls until the request completes: spinning for the first 2 ms (the usual case inside a
  // step), then every ~50 us, answering other ranks' questions meanwhile.
  void wait(MPI_Request& req, std::string_view what) {
    ++seq_;
    const auto start = Clock::now();
    const auto spin_until = start + std::chrono::milliseconds(2);
    const auto deadline = start + std::chrono::duration_cast<Clock::duration>(
                                      std::chrono::duration<double>(timeout_));
    for (;;) {
      int done = 0;
      check(MPI_Test(&req, &done, MPI_STATUS_IGNORE), what);
      if (done) return;
      const auto now = Clock::now();
      if (now < spin_until) continue;
      serve_asks();
      if (now >= deadline) timed_out(what);
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }

  [[noreturn]] void timed_out(std::string_view what) {
    g_failed = true;
    // Ask the others which collective they are in; wait up to 2 s for the answers.
    // The buffers are members: MPI may still touch them after this function has thrown.
    const size_t n = static_cast<size_t>(size_);
    std::vector<int64_t>& answer = answer_buf_;
    answer.assign(n, -1);
    std::vector<MPI_Request> recvs(n, MPI_REQUEST_NULL);
    std::vector<int> answered(n, 0);
    ask_buf_ = seq_;
    const int64_t mine = seq_;
    for (int q = 0; q < size_; ++q) {
      if (q == rank_) continue;
      MPI_Request s;
      if (MPI_Isend(&ask_buf_, 1, MPI_INT64_T, q, kAskTag, ctrl_, &s) == MPI_SUCCESS)
        MPI_Request_free(&s);
      MPI_Irecv(&answer[static_cast<size_t>(q)], 1, MPI_INT64_T, q, kReplyTag, ctrl_,
                &recvs[static_cast<size_t>(q)]);
    }
    const auto until = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                          std::chrono::duration<double>(std::min(2.0, timeout_)));
    while (Clock::now() < until) {
      serve_asks();
      bool all = true;
      for (int q = 0; q < size_; ++q) {
        const size_t i = static_cast<size_t>(q);
        if (q == rank_ || answered[i]) continue;
        if (recvs[i] != MPI_REQUEST_NULL) MPI_Test(&recvs[i], &answered[i], MPI_STATUS_IGNORE);
        all = all && answered[i];
      }
      if (all) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    for (MPI_Request& r : recvs) {
      if (r == MPI_REQUEST_NULL) continue;
      MPI_Cancel(&r);
      MPI_Request_free(&r);
    }
    std::string silent, elsewhere;
    for (int q = 0; q < size_; ++q) {
      const size_t i = static_cast<size_t>(q);
      if (q == rank_) continue;
      if (!answered[i]) {
        silent += detail::cat(silent.empty() ? "" : ", ", q);
      } else if (answer[i] != mine) {
        elsewhere += detail::cat(elsewhere.empty() ? "" : "; ", "rank ", q, " is at collective #",
                                 answer[i]);
      }
    }
    std::string msg = detail::cat("rank ", rank_, " timed out waiting for ", what, " (collective #",
                                  mine, ") after ", timeout_, " s (--comm-timeout); ");
    if (!silent.empty())
      msg += detail::cat("not arrived: rank(s) ", silent,
                         " did not respond (died, hung, or stuck outside any collective)");
    if (!elsewhere.empty()) msg += (silent.empty() ? "" : "; ") + elsewhere;
    if (silent.empty() && elsewhere.empty())
      msg += "every other rank answered from the same collective (MPI did not progress)";
    msg += "; the job is aborted";
    throw Error(msg);
  }

  double timeout_;
  MPI_Comm comm_ = MPI_COMM_NULL;  // collectives
  MPI_Comm ctrl_ = MPI_COMM_NULL;  // the questions asked after a timeout
  int rank_ = 0, size_ = 1, local_rank_ = 0;
  int64_t seq_ = 0;                  // collectives started by this rank
  std::vector<int64_t> reply_buf_;   // (world,) answers sent to each rank
  std::vector<int64_t> answer_buf_;  // (world,) answers received after a timeout
  int64_t ask_buf_ = 0;
};

}  // namespace

std::shared_ptr<Communicator> make_mpi_world_communicator(double timeout_s) {
  static MpiLifetime lifetime;  // finalised (or aborted) at exit
  return std::make_shared<MpiCommunicator>(timeout_s);
}

}  // namespace kvlab
