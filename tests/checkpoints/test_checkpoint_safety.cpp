// Damaged, hostile and foreign checkpoints: kvlab's digest catches every damaged byte of a file
// it wrote; a file it did not write cannot crash the process or make it allocate for a model
// the file does not hold; files a PyTorch user writes with h5py load.
#include <gtest/gtest.h>
#include <hdf5.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <bit>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <algorithm>
#include <random>

#include "checkpoints/model_io.h"
#include "tests/error_of.h"
#include "tests/test_dir.h"

namespace kvlab {
namespace {

namespace fs = std::filesystem;

std::string read_bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}

void write_bytes(const fs::path& p, const std::string& bytes) {
  std::ofstream(p, std::ios::binary | std::ios::trunc) << bytes;
}

// How a load ended, in a child process of the test's own, so that a crash is seen, not suffered.
// kContained: kvlab::Error saying that the HDF5 library crashed in the loader's checking child.
enum class Outcome { kLoadedSame, kLoadedDifferent, kError, kOtherException, kSignal, kContained };

struct ChildRun {
  Outcome outcome;
  int signal = 0;
  long growth_kb = 0;  // the child's peak resident memory (its own or its children's) less
                       // what it had at the fork
};

long resident_kb() {
  long pages = 0, resident = 0;
  std::FILE* f = std::fopen("/proc/self/statm", "r");
  if (f) {
    if (std::fscanf(f, "%ld %ld", &pages, &resident) != 2) resident = 0;
    std::fclose(f);
  }
  return resident * (::sysconf(_SC_PAGESIZE) / 1024);
}

// `load` returns whether what it loaded equals the undamaged file's content.
ChildRun run_in_child(const std::function<bool()>& load) {
  int fds[2];
  if (::pipe(fds) != 0) return {Outcome::kOtherException};
  std::fflush(nullptr);
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::close(fds[0]);
    const long start_kb = resident_kb();
    int code = 3;
    try {
      code = load() ? 0 : 2;
    } catch (const Error& e) {
      code = std::string(e.what()).find("the HDF5 library crashed") != std::string::npos ? 4 : 1;
    } catch (...) {
      code = 3;
    }
    rusage self{}, children{};
    ::getrusage(RUSAGE_SELF, &self);
    ::getrusage(RUSAGE_CHILDREN, &children);
    const long growth = std::max(self.ru_maxrss, children.ru_maxrss) - start_kb;
    if (::write(fds[1], &growth, sizeof growth) != sizeof growth) code = 3;
    ::_exit(code);
  }
  ::close(fds[1]);
  ChildRun r{Outcome::kOtherException};
  if (::read(fds[0], &r.growth_kb, sizeof r.growth_kb) != sizeof r.growth_kb) r.growth_kb = -1;
  ::close(fds[0]);
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (WIFSIGNALED(status)) {
    r.outcome = Outcome::kSignal;
    r.signal = WTERMSIG(status);
  } else if (WIFEXITED(status)) {
    const int code = WEXITSTATUS(status);
    r.outcome = code == 0   ? Outcome::kLoadedSame
                : code == 2 ? Outcome::kLoadedDifferent
                : code == 1 ? Outcome::kError
                : code == 4 ? Outcome::kContained
                            : Outcome::kOtherException;
  }
  return r;
}

bool same_arrays(const NamedArrays& a, const NamedArrays& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].first != b[i].first || a[i].second.shape != b[i].second.shape) return false;
    for (size_t j = 0; j < a[i].second.data.size(); ++j)
      if (std::bit_cast<uint32_t>(a[i].second.data[j]) !=
          std::bit_cast<uint32_t>(b[i].second.data[j]))
        return false;
  }
  return true;
}

// The user block holding kvlab's digest, dropped: HDF5 addresses are relative to the
// superblock, so the rest is the same file without one, as h5py or an older kvlab writes it.
std::string without_digest(const std::string& bytes) { return bytes.substr(512); }

class CheckpointSafety : public testing::TestDirFixture {
 protected:
  CheckpointSafety() : TestDirFixture("kvlab-ckpt-safety") {}

  void SetUp() override {
    TestDirFixture::SetUp();
    tok_ = Tokenizer::build_char("abcdefgh");
    cfg_.vocab_size = tok_.vocab_size();
    cfg_.block_size = 8;
    cfg_.n_layer = 1;
    cfg_.n_head = 2;
    cfg_.n_kv_head = 1;
    cfg_.n_embd = 8;
    GPT model(cfg_, 1);
    put_gpt_config(ckpt_.config, cfg_);
    put_tokenizer(ckpt_, tok_);
    ckpt_.model = to_arrays(model.named_parameters());
    ckpt_.has_optimizer = true;
    ckpt_.optimizer_step = 3;
    ckpt_.optimizer_m = ckpt_.model;
    ckpt_.optimizer_v = ckpt_.model;
    ckpt_.has_train_state = true;
    ckpt_.iteration = 3;
    ckpt_.rng_state = {1, 2, 3, 4, 5, 6, 7, 8};
    ckpt_.train_extra = {{"world_size", int64_t{1}}};
    file_ = dir_ / "final.h5";
    save_checkpoint(file_, ckpt_);
  }

  // The three ways kvlab reads a checkpoint: generate and bench (the model), --resume (the
  // model and its training state) and inspect (whatever is there).
  bool load_as_generate(const fs::path& f) const {
    return same_arrays(to_arrays(load_model(f).model->named_parameters()), ckpt_.model);
  }
  bool load_as_resume(const fs::path& f) const {
    const Checkpoint c = load_checkpoint(f, gpt_load_options(f, true));
    return same_arrays(c.model, ckpt_.model) && same_arrays(c.optimizer_m, ckpt_.optimizer_m) &&
           same_arrays(c.optimizer_v, ckpt_.optimizer_v) && c.rng_state == ckpt_.rng_state;
  }
  bool load_as_inspect(const fs::path& f) const {
    LoadOptions options;
    options.report_training_state = true;
    const Checkpoint c = load_checkpoint(f, options);
    return same_arrays(c.model, ckpt_.model) && c.training_state_problem.empty();
  }

  Tokenizer tok_ = Tokenizer::byte_level();
  GPTConfig cfg_;
  Checkpoint ckpt_;
  fs::path file_;
};

TEST_F(CheckpointSafety, KvlabFilesCarryTheirDigestAndLoad) {
  const std::string bytes = read_bytes(file_);
  ASSERT_TRUE(bytes.starts_with("kvlab-checkpoint-digest 1\ncrc32 ")) << bytes.substr(0, 64);
  EXPECT_TRUE(load_as_generate(file_));
  EXPECT_TRUE(load_as_resume(file_));
  EXPECT_TRUE(load_as_inspect(file_));
  // Without the digest, the same file loads through the checking child process.
  write_bytes(file_, without_digest(bytes));
  EXPECT_TRUE(load_as_generate(file_));
  EXPECT_TRUE(load_as_resume(file_));
}

// Bytes of a kvlab-written file, each changed: every change is refused, none loads. The whole
// user block and then every 13th byte (CRC-32 catches any one damaged byte wherever it is).
TEST_F(CheckpointSafety, EveryDamagedByteIsRefused) {
  const std::string bytes = read_bytes(file_);
  const fs::path damaged = dir_ / "damaged.h5";
  int tried = 0, refused = 0;
  for (size_t at = 0; at < bytes.size(); at += at < 512 ? 1 : 13) {
    std::string mutant = bytes;
    mutant[at] = static_cast<char>(mutant[at] ^ (1 << (at % 8)));
    write_bytes(damaged, mutant);
    const std::string msg = error_of([&] { load_model(damaged); });
    ++tried;
    if (msg != "no error") ++refused;
    EXPECT_NE(msg, "no error") << "byte " << at << " of " << bytes.size();
    if (at == 0) {  // the digest's own header damaged: a user block that is not kvlab's
      EXPECT_NE(msg.find("user block is not a kvlab digest"), std::string::npos) << msg;
    } else if (at == 4096) {  // past the digest: says what is wrong
      EXPECT_NE(msg.find("no longer match the digest"), std::string::npos) << msg;
    }
  }
  EXPECT_EQ(refused, tried);
  std::printf("[ digest   ] %d of %d single-byte changes refused (file of %zu bytes)\n", refused,
              tried, bytes.size());
}

TEST_F(CheckpointSafety, WhatIsNotARegularFileIsRefusedAtOnce) {
  const fs::path fifo = dir_ / "fifo.h5";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  std::string msg = error_of([&] { load_model(fifo); });
  EXPECT_NE(msg.find("not a regular file"), std::string::npos) << msg;
  msg = error_of([&] { load_model(dir_); });
  EXPECT_NE(msg.find("is a directory"), std::string::npos) << msg;
}

// A config that describes a far larger model than the file holds (block_size 2^27 here: 4 GiB
// of position table) is refused by comparing shapes, before anything is allocated for it.
TEST_F(CheckpointSafety, ConfigIsComparedWithTheDatasetsBeforeAllocating) {
  Checkpoint big = ckpt_;
  big.config["block_size"] = int64_t{1} << 27;
  const fs::path f = dir_ / "big.h5";
  save_checkpoint(f, big);
  const std::string msg = error_of([&] { load_model(f); });
  EXPECT_NE(msg.find("/model/wpe.weight: shape (8, 8) in the file, the model expects "
                     "(134217728, 8)"),
            std::string::npos)
      << msg;
  const ChildRun clean = run_in_child([&] { return load_as_generate(file_); });
  const ChildRun refused = run_in_child([&] { return load_as_generate(f); });
  ASSERT_EQ(clean.outcome, Outcome::kLoadedSame);
  ASSERT_EQ(refused.outcome, Outcome::kError);
  EXPECT_LT(refused.growth_kb, clean.growth_kb + 64 * 1024)
      << "growth KiB: refused " << refused.growth_kb << ", clean " << clean.growth_kb;
}

// Objects whose bytes live outside the checkpoint are refused: raw storage in an external file,
// links to other files, soft links, virtual datasets.
TEST_F(CheckpointSafety, StorageOutsideTheFileIsRefused) {
  const fs::path elsewhere = dir_ / "elsewhere.bin";
  const NamedArrays& m = ckpt_.model;
  const ArrayF32& wte = m[0].second;
  ASSERT_EQ(m[0].first, "wte.weight");
  write_bytes(elsewhere, std::string(reinterpret_cast<const char*>(wte.data.data()),
                                     wte.data.size() * sizeof(float)));
  struct Case {
    const char* what;
    std::function<void(hid_t)> edit;
    const char* expect;
  };
  const hsize_t dims[2] = {static_cast<hsize_t>(wte.shape[0]), static_cast<hsize_t>(wte.shape[1])};
  // /model/wte.weight made again with the creation properties `set` gives it.
  const auto replace_wte = [&](hid_t f, const std::function<herr_t(hid_t, hid_t)>& set) {
    ASSERT_GE(H5Ldelete(f, "/model/wte.weight", H5P_DEFAULT), 0);
    const hid_t dcpl = H5Pcreate(H5P_DATASET_CREATE);
    const hid_t space = H5Screate_simple(2, dims, nullptr);
    ASSERT_GE(set(dcpl, space), 0);
    const hid_t d = H5Dcreate2(f, "/model/wte.weight", H5T_IEEE_F32LE, space, H5P_DEFAULT, dcpl,
                               H5P_DEFAULT);
    ASSERT_GE(d, 0);
    H5Dclose(d);
    H5Sclose(space);
    H5Pclose(dcpl);
  };
  const std::vector<Case> cases = {
      {"external raw storage",
       [&](hid_t f) {
         replace_wte(f, [&](hid_t dcpl, hid_t) {
           return H5Pset_external(dcpl, elsewhere.c_str(), 0, dims[0] * dims[1] * 4);
         });
       },
       "/model/wte.weight: its values are stored in external files"},
      {"external link",
       [&](hid_t f) {
         ASSERT_GE(H5Ldelete(f, "/model/wte.weight", H5P_DEFAULT), 0);
         ASSERT_GE(H5Lcreate_external(elsewhere.c_str(), "/x", f, "/model/wte.weight",
                                      H5P_DEFAULT, H5P_DEFAULT),
                   0);
       },
       "/model/wte.weight is a soft or external link"},
      {"soft link",
       [&](hid_t f) {
         ASSERT_GE(H5Ldelete(f, "/model/wte.weight", H5P_DEFAULT), 0);
         ASSERT_GE(H5Lcreate_soft("/model/wpe.weight", f, "/model/wte.weight", H5P_DEFAULT,
                                  H5P_DEFAULT),
                   0);
       },
       "/model/wte.weight is a soft or external link"},
      {"virtual dataset",
       [&](hid_t f) {
         replace_wte(f, [&](hid_t dcpl, hid_t space) {
           return H5Pset_virtual(dcpl, space, elsewhere.c_str(), "/x", space);
         });
       },
       "/model/wte.weight: a virtual dataset"},
  };
  for (const Case& c : cases) {
    save_checkpoint(file_, ckpt_);
    write_bytes(file_, without_digest(read_bytes(file_)));
    const hid_t f = H5Fopen(file_.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
    ASSERT_GE(f, 0);
    c.edit(f);
    ASSERT_GE(H5Fclose(f), 0);
    for (const auto& load : {std::function<void()>([&] { load_model(file_); }),
                             std::function<void()>([&] { load_as_inspect(file_); })}) {
      const std::string msg = error_of(load);
      EXPECT_NE(msg.find(c.expect), std::string::npos) << c.what << ": " << msg;
    }
  }
}

std::string shell_quote(const std::string& s) { return "'" + s + "'"; }

// Files written the way h5py writes them load: gzip, shuffle and fletcher32 datasets, groups
// without tracked creation order (parameters are matched by name, not position).
TEST_F(CheckpointSafety, FilesWrittenByH5pyLoad) {
  const std::string python = KVLAB_PYTHON3;
  const fs::path script = fs::path(KVLAB_SOURCE_DIR) / "tests/checkpoints/rewrite_with_h5py.py";
  for (const std::string flags : {"", "--gzip", "--fletcher32", "--gzip --fletcher32"}) {
    const fs::path out = dir_ / "h5py.h5", err = dir_ / "err.txt";
    const std::string cmd = shell_quote(python) + " " + shell_quote(script) + " " +
                            shell_quote(file_) + " " + shell_quote(out) + " " + flags + " 2>" +
                            shell_quote(err);
    const int rc = std::system(cmd.c_str());
    ASSERT_TRUE(WIFEXITED(rc) && WEXITSTATUS(rc) == 0) << cmd << "\n" << read_bytes(err);
    EXPECT_TRUE(load_as_generate(out)) << flags;
    EXPECT_TRUE(load_as_resume(out)) << flags;
    if (flags.find("fletcher32") != std::string::npos) {
      // The last bytes of the file are a chunk's data or its checksum: HDF5 verifies them.
      std::string bytes = read_bytes(out);
      hid_t f = H5Fopen(out.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
      ASSERT_GE(f, 0);
      const hid_t d = H5Dopen2(f, "/model/blocks.0.mlp.c_fc.weight", H5P_DEFAULT);
      const hid_t space = H5Dget_space(d);
      haddr_t offset = 0;
      hsize_t size = 0;
      ASSERT_GE(H5Dget_chunk_info(d, space, 0, nullptr, nullptr, &offset, &size), 0);
      H5Sclose(space);
      H5Dclose(d);
      H5Fclose(f);
      bytes[offset + size / 2] ^= 0x10;
      write_bytes(out, bytes);
      const std::string msg = error_of([&] { load_model(out); });
      EXPECT_NE(msg.find("/model/blocks.0.mlp.c_fc.weight"), std::string::npos) << msg;
    }
  }
}

// crashes_libhdf5.h5: a small GPT's checkpoint without digest, four bytes of its metadata
// changed, on which libhdf5 1.10.8 dies by SIGSEGV (h5py reading it too). kvlab's loader must
// end in an error, whichever way the library fails.
TEST_F(CheckpointSafety, AFileThatCrashesHdf5IsAnError) {
  const fs::path f = fs::path(KVLAB_SOURCE_DIR) / "tests/checkpoints/crashes_libhdf5.h5";
  for (const auto& load : {std::function<bool()>([&] { return load_as_generate(f); }),
                           std::function<bool()>([&] { return load_as_inspect(f); })}) {
    const ChildRun r = run_in_child(load);
    EXPECT_TRUE(r.outcome == Outcome::kContained || r.outcome == Outcome::kError)
        << "outcome " << static_cast<int>(r.outcome) << ", signal " << r.signal;
  }
  const std::string msg = error_of([&] { load_model(f); });
  EXPECT_NE(msg.find(f.string()), std::string::npos) << msg;
  std::printf("[ crash    ] %s\n", msg.c_str());
}

// loops_libhdf5.h5: a small GPT's checkpoint without digest, some bytes changed, on which
// libhdf5 1.10.8 never returns from reading the root's 'format' attribute (h5py neither). The
// loader's checking child runs out of its CPU budget and the load ends in an error.
TEST_F(CheckpointSafety, AFileOnWhichHdf5LoopsIsAnError) {
  const fs::path f = fs::path(KVLAB_SOURCE_DIR) / "tests/checkpoints/loops_libhdf5.h5";
  const std::string msg = error_of([&] { load_model(f); });
  EXPECT_NE(msg.find(f.string()), std::string::npos) << msg;
  EXPECT_NE(msg.find("did not finish reading it in 5 s of CPU time"), std::string::npos) << msg;
}

// Seeded byte mutations of a real checkpoint, loaded the three ways kvlab loads one, each in a
// child process of the test: never a signal, never an exception other than kvlab::Error, never
// a peak of memory beyond the clean load's; a kvlab-written file is refused every time.
TEST_F(CheckpointSafety, FuzzedCheckpointsNeverCrash) {
  const std::string sealed = read_bytes(file_);
  const std::string foreign = without_digest(sealed);
  // Where the foreign file's raw values lie: everything else is metadata.
  const fs::path plain = dir_ / "plain.h5";
  write_bytes(plain, foreign);
  std::vector<bool> is_raw(foreign.size(), false);
  {
    const hid_t f = H5Fopen(plain.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
    ASSERT_GE(f, 0);
    H5Ovisit(
        f, H5_INDEX_NAME, H5_ITER_INC,
        [](hid_t root, const char* name, const H5O_info_t* info, void* out) -> herr_t {
          if (info->type != H5O_TYPE_DATASET) return 0;
          const hid_t d = H5Dopen2(root, name, H5P_DEFAULT);
          const haddr_t at = H5Dget_offset(d);
          const hsize_t n = H5Dget_storage_size(d);
          auto& raw = *static_cast<std::vector<bool>*>(out);
          for (hsize_t i = 0; at != HADDR_UNDEF && i < n && at + i < raw.size(); ++i)
            raw[at + i] = true;
          H5Dclose(d);
          return 0;
        },
        &is_raw);
    H5Fclose(f);
  }
  std::vector<size_t> metadata;
  for (size_t i = 0; i < is_raw.size(); ++i)
    if (!is_raw[i]) metadata.push_back(i);
  ASSERT_GT(metadata.size(), 1000u);

  const ChildRun clean = run_in_child([&] { return load_as_resume(file_); });
  ASSERT_EQ(clean.outcome, Outcome::kLoadedSame);
  const long growth_limit_kb = clean.growth_kb + 64 * 1024;

  std::mt19937_64 rng(20261203);
  struct Kind {
    const char* name;
    const std::string* original;
    bool metadata_only;
    int mutants;
  };
  const Kind kinds[] = {{"kvlab file, anywhere", &sealed, false, 120},
                        {"foreign file, metadata", &foreign, true, 150},
                        {"foreign file, anywhere", &foreign, false, 60}};
  const fs::path mutant_file = dir_ / "mutant.h5";
  for (const Kind& kind : kinds) {
    int counts[6] = {};
    for (int m = 0; m < kind.mutants; ++m) {
      std::string mutant = *kind.original;
      const int changes = 1 + static_cast<int>(rng() % 4);
      for (int c = 0; c < changes; ++c) {
        const size_t at = kind.metadata_only ? metadata[rng() % metadata.size()]
                                             : static_cast<size_t>(rng() % mutant.size());
        mutant[at] = static_cast<char>(rng() % 3 == 0 ? 0xff : rng() & 0xff);
      }
      write_bytes(mutant_file, mutant);
      for (const auto& load : {std::function<bool()>([&] { return load_as_generate(mutant_file); }),
                               std::function<bool()>([&] { return load_as_resume(mutant_file); }),
                               std::function<bool()>([&] { return load_as_inspect(mutant_file); })}) {
        const ChildRun r = run_in_child(load);
        ++counts[static_cast<int>(r.outcome)];
        EXPECT_NE(r.outcome, Outcome::kSignal)
            << kind.name << " mutant " << m << ": signal " << r.signal;
        EXPECT_NE(r.outcome, Outcome::kOtherException) << kind.name << " mutant " << m;
        EXPECT_LE(r.growth_kb, growth_limit_kb) << kind.name << " mutant " << m;
        if (kind.original == &sealed && mutant != sealed) {  // refused by the digest
          EXPECT_EQ(r.outcome, Outcome::kError) << kind.name << " mutant " << m;
        }
      }
    }
    std::printf("[ fuzz     ] %-24s %3d mutants x 3 loads: %d refused (%d of them HDF5 crashes "
                "contained), %d loaded unchanged, %d loaded changed values, %d other "
                "exceptions, %d signals\n",
                kind.name, kind.mutants, counts[2] + counts[5], counts[5], counts[0], counts[1],
                counts[3], counts[4]);
  }
}

}  // namespace
}  // namespace kvlab
