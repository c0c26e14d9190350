#include <gtest/gtest.h>
#include <hdf5.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>

#include <bit>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <limits>
#include <sstream>

#include "checkpoints/checkpoint.h"
#include "platform/error.h"
#include "tests/test_dir.h"

namespace kvlab {
namespace {

namespace fs = std::filesystem;

ArrayF32 ramp(std::vector<int64_t> shape, float start) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  ArrayF32 a{std::move(shape), std::vector<float>(n)};
  for (int64_t i = 0; i < n; ++i) a.data[i] = start + 0.25f * static_cast<float>(i);
  return a;
}

// Names deliberately not in alphabetical order: the file must keep the write order.
NamedArrays sample_params(float start) {
  NamedArrays p = {{"wte.weight", ramp({5, 3}, start)},
                   {"blocks.0.attn.q_proj.weight", ramp({3, 3}, start + 1)},
                   {"blocks.0.attn.q_proj.bias", ramp({3}, start + 2)},
                   {"blocks.0.ln_1.weight", ramp({3}, start + 3)},
                   {"a_head.weight", ramp({2, 3}, start + 4)}};
  // Values whose bits must survive: -0, infinities, a NaN payload, a denormal, the largest float.
  std::vector<float>& w = p[0].second.data;
  w[0] = -0.0f;
  w[1] = INFINITY;
  w[2] = -INFINITY;
  w[3] = std::bit_cast<float>(0x7fc12345u);
  w[4] = std::bit_cast<float>(0x00000001u);
  w[5] = std::numeric_limits<float>::max();
  return p;
}

Checkpoint sample_checkpoint() {
  Checkpoint c;
  c.config = {{"n_layer", int64_t{2}},  {"big", int64_t{1} << 62},
              {"neg", int64_t{-7}},     {"lr", 3e-4},
              {"third", 1.0 / 3.0},     {"attention", std::string("gqa")},
              {"empty", std::string()}, {"utf8", std::string("h\xc3\xa9llo \xf0\x9f\x98\x80")}};
  c.tokenizer_kind = "char";
  c.tokenizer_vocab = {0, 10, 65, 0xE9, 0x1F600, 0xFFFFFFFFu};
  c.model = sample_params(0.5f);
  c.has_optimizer = true;
  c.optimizer_step = 123;
  c.optimizer_m = sample_params(-10.0f);
  c.optimizer_v = sample_params(20.0f);
  c.has_train_state = true;
  c.iteration = 4567;
  c.best_val_loss = 1.2345678901234567;
  c.rng_state = {0, 1, 0xFFFFFFFFFFFFFFFFull, 0x8000000000000000ull, 0x0123456789ABCDEFull};
  c.train_extra = {{"world_size", int64_t{2}}, {"elapsed_s", 12.5}, {"git", std::string("abc")}};
  return c;
}

void expect_same_arrays(const NamedArrays& a, const NamedArrays& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].first, b[i].first) << "parameter " << i;
    EXPECT_EQ(a[i].second.shape, b[i].second.shape) << a[i].first;
    ASSERT_EQ(a[i].second.data.size(), b[i].second.data.size()) << a[i].first;
    for (size_t j = 0; j < a[i].second.data.size(); ++j) {
      EXPECT_EQ(std::bit_cast<uint32_t>(a[i].second.data[j]),
                std::bit_cast<uint32_t>(b[i].second.data[j]))
          << a[i].first << "[" << j << "]";
    }
  }
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected kvlab::Error";
  return "";
}

std::string read_text(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}

// Drops the user block holding kvlab's digest: HDF5 addresses are relative to the superblock,
// so the rest is the same HDF5 file without one, as h5py would write it.
void strip_digest(const fs::path& p) {
  const std::string bytes = read_text(p);
  if (!bytes.starts_with("kvlab-checkpoint-digest")) return;
  std::ofstream(p, std::ios::binary | std::ios::trunc) << bytes.substr(512);
}

class CheckpointTest : public testing::TestDirFixture {
 protected:
  CheckpointTest() : TestDirFixture("kvlab-ckpt") {}
  void SetUp() override {
    TestDirFixture::SetUp();
    file_ = dir_ / "model.h5";
  }

  // Opens file_ read-write for a test that damages it; the handle closes when `edit` returns.
  // The file then loses kvlab's digest, which it would no longer match: it stands for a file
  // kvlab did not write, whose structure the loader must check for itself.
  void edit_file(const std::function<void(hid_t)>& edit) {
    const hid_t f = H5Fopen(file_.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
    ASSERT_GE(f, 0);
    edit(f);
    ASSERT_GE(H5Fclose(f), 0);
    strip_digest(file_);
  }

  std::string load_error(bool with_training_state = true) {
    return error_of([&] { load_checkpoint(file_, with_training_state); });
  }

  fs::path file_;
};

TEST_F(CheckpointTest, RoundTripKeepsEverything) {
  const Checkpoint c = sample_checkpoint();
  save_checkpoint(file_, c);
  const Checkpoint r = load_checkpoint(file_);
  EXPECT_EQ(r.config, c.config);
  EXPECT_EQ(r.tokenizer_kind, c.tokenizer_kind);
  EXPECT_EQ(r.tokenizer_vocab, c.tokenizer_vocab);
  expect_same_arrays(r.model, c.model);
  EXPECT_TRUE(r.has_optimizer);
  EXPECT_EQ(r.optimizer_step, 123);
  expect_same_arrays(r.optimizer_m, c.optimizer_m);
  expect_same_arrays(r.optimizer_v, c.optimizer_v);
  EXPECT_TRUE(r.has_train_state);
  EXPECT_EQ(r.iteration, 4567);
  EXPECT_EQ(std::bit_cast<uint64_t>(r.best_val_loss), std::bit_cast<uint64_t>(c.best_val_loss));
  EXPECT_EQ(r.rng_state, c.rng_state);
  EXPECT_EQ(r.train_extra, c.train_extra);
}

TEST_F(CheckpointTest, RoundTripWithoutOptionalStateAndInfiniteBestLoss) {
  Checkpoint c = sample_checkpoint();
  c.has_optimizer = false;
  save_checkpoint(file_, c);
  Checkpoint r = load_checkpoint(file_);
  EXPECT_FALSE(r.has_optimizer);
  EXPECT_TRUE(r.optimizer_m.empty());
  EXPECT_TRUE(r.has_train_state);

  c = sample_checkpoint();
  c.has_train_state = false;
  c.best_val_loss = std::numeric_limits<double>::infinity();
  save_checkpoint(file_, c);
  r = load_checkpoint(file_);
  EXPECT_TRUE(r.has_optimizer);
  EXPECT_FALSE(r.has_train_state);
  EXPECT_TRUE(r.rng_state.empty());

  c.has_train_state = true;
  c.rng_state.clear();
  c.tokenizer_vocab.clear();
  save_checkpoint(file_, c);
  r = load_checkpoint(file_);
  EXPECT_TRUE(std::isinf(r.best_val_loss) && r.best_val_loss > 0);
  EXPECT_TRUE(r.rng_state.empty());
  EXPECT_TRUE(r.tokenizer_vocab.empty());
}

TEST_F(CheckpointTest, WithoutTrainingStateSkipsOptimizerAndTrain) {
  const Checkpoint c = sample_checkpoint();
  save_checkpoint(file_, c);
  const Checkpoint r = load_checkpoint(file_, /*with_training_state=*/false);
  EXPECT_EQ(r.config, c.config);
  expect_same_arrays(r.model, c.model);
  EXPECT_FALSE(r.has_optimizer);
  EXPECT_FALSE(r.has_train_state);
  EXPECT_TRUE(r.optimizer_m.empty() && r.optimizer_v.empty() && r.rng_state.empty());
  EXPECT_TRUE(r.train_extra.empty());
  EXPECT_EQ(r.iteration, 0);

  // A damaged optimizer does not matter when it is not read.
  edit_file([](hid_t f) { ASSERT_GE(H5Ldelete(f, "/optimizer/m", H5P_DEFAULT), 0); });
  EXPECT_NO_THROW(load_checkpoint(file_, false));
  EXPECT_THROW(load_checkpoint(file_, true), Error);
}

TEST_F(CheckpointTest, LayoutIsTheDocumentedOne) {
  save_checkpoint(file_, sample_checkpoint());
  const hid_t f = H5Fopen(file_.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
  ASSERT_GE(f, 0);
  // One dataset per parameter, the dotted name inside /model, no nested groups.
  EXPECT_GT(H5Lexists(f, "/model/blocks.0.attn.q_proj.weight", H5P_DEFAULT), 0);
  EXPECT_EQ(H5Lexists(f, "/model/blocks", H5P_DEFAULT), 0);
  EXPECT_GT(H5Lexists(f, "/optimizer/m/blocks.0.attn.q_proj.weight", H5P_DEFAULT), 0);
  EXPECT_GT(H5Lexists(f, "/train/rng_state", H5P_DEFAULT), 0);
  EXPECT_GT(H5Aexists(f, "format"), 0);
  EXPECT_GT(H5Aexists(f, "format_version"), 0);
  const hid_t d = H5Dopen2(f, "/model/wte.weight", H5P_DEFAULT);
  ASSERT_GE(d, 0);
  const hid_t t = H5Dget_type(d);
  EXPECT_GT(H5Tequal(t, H5T_IEEE_F32LE), 0);
  const hid_t s = H5Dget_space(d);
  hsize_t dims[2] = {0, 0};
  EXPECT_EQ(H5Sget_simple_extent_dims(s, dims, nullptr), 2);
  EXPECT_EQ(dims[0], 5u);
  EXPECT_EQ(dims[1], 3u);
  H5Sclose(s);
  H5Tclose(t);
  H5Dclose(d);
  H5Fclose(f);
}

TEST_F(CheckpointTest, SaveLeavesNoTemporaryFileAndReplacesOldCheckpoint) {
  Checkpoint c = sample_checkpoint();
  save_checkpoint(file_, c);
  c.iteration = 9999;
  save_checkpoint(file_, c);
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir_)) names.push_back(e.path().filename());
  EXPECT_EQ(names, std::vector<std::string>{"model.h5"});
  EXPECT_EQ(load_checkpoint(file_).iteration, 9999);
}

TEST_F(CheckpointTest, SaveCreatesFolders) {
  const fs::path nested = dir_ / "a" / "b" / "model.h5";
  save_checkpoint(nested, sample_checkpoint());
  EXPECT_EQ(load_checkpoint(nested).iteration, 4567);
}

TEST_F(CheckpointTest, InvalidCheckpointIsRejectedAndOldOneKept) {
  save_checkpoint(file_, sample_checkpoint());
  Checkpoint bad = sample_checkpoint();
  bad.iteration = 1;
  bad.model[1].second.shape = {3, 4};  // 9 values for 12 elements
  const std::string msg = error_of([&] { save_checkpoint(file_, bad); });
  EXPECT_NE(msg.find("model.h5"), std::string::npos) << msg;
  EXPECT_NE(msg.find("/model/blocks.0.attn.q_proj.weight"), std::string::npos) << msg;

  bad = sample_checkpoint();
  bad.optimizer_v.pop_back();
  EXPECT_THROW(save_checkpoint(file_, bad), Error);
  bad = sample_checkpoint();
  bad.model.push_back(bad.model[0]);
  EXPECT_THROW(save_checkpoint(file_, bad), Error);

  EXPECT_EQ(load_checkpoint(file_).iteration, 4567);
  EXPECT_EQ(std::distance(fs::directory_iterator(dir_), fs::directory_iterator()), 1);
}

// Restores the file size limit and SIGXFSZ handling on scope exit.
class FileSizeLimit {
 public:
  explicit FileSizeLimit(rlim_t bytes) {
    getrlimit(RLIMIT_FSIZE, &old_);
    old_handler_ = signal(SIGXFSZ, SIG_IGN);  // writes past the limit then fail with EFBIG
    rlimit lim = old_;
    lim.rlim_cur = bytes;
    setrlimit(RLIMIT_FSIZE, &lim);
  }
  ~FileSizeLimit() {
    setrlimit(RLIMIT_FSIZE, &old_);
    signal(SIGXFSZ, old_handler_);
  }

 private:
  rlimit old_{};
  sighandler_t old_handler_;
};

TEST_F(CheckpointTest, DiskFullDuringSaveKeepsOldCheckpoint) {
  save_checkpoint(file_, sample_checkpoint());
  ASSERT_LT(fs::file_size(file_), 64u * 1024);
  Checkpoint big = sample_checkpoint();
  big.iteration = 1;
  big.model.emplace_back("big.weight", ramp({1024, 1024}, 0.0f));  // 4 MiB
  big.has_optimizer = false;
  std::string msg;
  {
    FileSizeLimit limit(64 * 1024);
    msg = error_of([&] { save_checkpoint(file_, big); });
  }
  EXPECT_NE(msg.find("model.h5"), std::string::npos) << msg;
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir_)) names.push_back(e.path().filename());
  EXPECT_EQ(names, std::vector<std::string>{"model.h5"}) << "temporary file left behind";
  const Checkpoint r = load_checkpoint(file_);
  EXPECT_EQ(r.iteration, 4567);
  expect_same_arrays(r.model, sample_checkpoint().model);
}

TEST_F(CheckpointTest, UncreatableFolderIsNamed) {
  std::ofstream(dir_ / "blocker") << "a file, not a folder";
  const fs::path target = dir_ / "blocker" / "sub" / "model.h5";
  const std::string msg = error_of([&] { save_checkpoint(target, sample_checkpoint()); });
  EXPECT_NE(msg.find((dir_ / "blocker" / "sub").string()), std::string::npos) << msg;
}

TEST_F(CheckpointTest, MissingFile) {
  const std::string msg = load_error();
  EXPECT_NE(msg.find("checkpoint: " + file_.string() + ": no such file"), std::string::npos) << msg;
}

TEST_F(CheckpointTest, TextFileNamedH5) {
  std::ofstream(file_) << "step,loss\n1,4.2\n";
  const std::string msg = load_error();
  EXPECT_NE(msg.find(file_.string()), std::string::npos) << msg;
  EXPECT_NE(msg.find("not an HDF5 file"), std::string::npos) << msg;
}

TEST_F(CheckpointTest, TruncatedFile) {
  save_checkpoint(file_, sample_checkpoint());
  const std::string bytes = read_text(file_);
  std::ofstream(file_, std::ios::binary | std::ios::trunc) << bytes.substr(0, bytes.size() / 2);
  const std::string msg = load_error();
  EXPECT_NE(msg.find(file_.string()), std::string::npos) << msg;
}

TEST_F(CheckpointTest, MissingOrWrongFormatAttribute) {
  save_checkpoint(file_, sample_checkpoint());
  edit_file([](hid_t f) { ASSERT_GE(H5Adelete(f, "format"), 0); });
  std::string msg = load_error();
  EXPECT_NE(msg.find(file_.string()), std::string::npos) << msg;
  EXPECT_NE(msg.find("missing attribute 'format'"), std::string::npos) << msg;

  edit_file([](hid_t f) {
    const hid_t space = H5Screate(H5S_SCALAR);
    const hid_t attr = H5Acreate2(f, "format", H5T_STD_I64LE, space, H5P_DEFAULT, H5P_DEFAULT);
    const int64_t v = 7;
    ASSERT_GE(H5Awrite(attr, H5T_NATIVE_INT64, &v), 0);
    H5Aclose(attr);
    H5Sclose(space);
  });
  msg = load_error();
  EXPECT_NE(msg.find("'format' of / is 7, expected \"kvlab-checkpoint\""), std::string::npos)
      << msg;
}

TEST_F(CheckpointTest, UnsupportedVersion) {
  save_checkpoint(file_, sample_checkpoint());
  edit_file([](hid_t f) {
    const hid_t attr = H5Aopen(f, "format_version", H5P_DEFAULT);
    const int64_t v = 2;
    ASSERT_GE(H5Awrite(attr, H5T_NATIVE_INT64, &v), 0);
    H5Aclose(attr);
  });
  const std::string msg = load_error();
  EXPECT_NE(msg.find(file_.string()), std::string::npos) << msg;
  EXPECT_NE(msg.find("unsupported format_version 2"), std::string::npos) << msg;
}

TEST_F(CheckpointTest, DeletedDatasetOrGroupIsNamed) {
  for (const char* path : {"/tokenizer/vocab", "/train/rng_state", "/model",
                           "/optimizer/m/blocks.0.attn.q_proj.weight", "/optimizer/v"}) {
    save_checkpoint(file_, sample_checkpoint());
    edit_file([&](hid_t f) { ASSERT_GE(H5Ldelete(f, path, H5P_DEFAULT), 0); });
    const std::string msg = load_error();
    EXPECT_NE(msg.find(file_.string()), std::string::npos) << msg;
    EXPECT_NE(msg.find(std::string("missing ")), std::string::npos) << msg;
    EXPECT_NE(msg.find(path), std::string::npos) << msg;
  }
  // An extra dataset in /optimizer/m that /model lacks.
  save_checkpoint(file_, sample_checkpoint());
  edit_file([](hid_t f) { ASSERT_GE(H5Ldelete(f, "/model/a_head.weight", H5P_DEFAULT), 0); });
  const std::string msg = load_error();
  EXPECT_NE(msg.find("/optimizer/m has 5 datasets, /model has 4"), std::string::npos) << msg;
}

// Replaces the dataset at `path` with one of the given type and shape, its values zero bytes.
void replace_dataset(hid_t f, const char* path, hid_t type, std::vector<hsize_t> dims) {
  ASSERT_GE(H5Ldelete(f, path, H5P_DEFAULT), 0);
  const hid_t space = H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr);
  const hid_t d = H5Dcreate2(f, path, type, space, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
  ASSERT_GE(d, 0);
  const std::vector<char> zeros(H5Tget_size(type) * H5Sget_simple_extent_npoints(space));
  ASSERT_GE(H5Dwrite(d, type, H5S_ALL, H5S_ALL, H5P_DEFAULT, zeros.data()), 0);
  H5Dclose(d);
  H5Sclose(space);
}

// A chunked dataset whose chunks were never written declares values the file does not hold:
// refused before anything is allocated for them (2^40 floats here).
TEST_F(CheckpointTest, DatasetNotAllStoredIsRefused) {
  save_checkpoint(file_, sample_checkpoint());
  edit_file([](hid_t f) {
    ASSERT_GE(H5Ldelete(f, "/model/wte.weight", H5P_DEFAULT), 0);
    const hsize_t dims[1] = {hsize_t{1} << 40}, chunk[1] = {1024};
    const hid_t space = H5Screate_simple(1, dims, nullptr);
    const hid_t plist = H5Pcreate(H5P_DATASET_CREATE);
    ASSERT_GE(H5Pset_chunk(plist, 1, chunk), 0);
    const hid_t d =
        H5Dcreate2(f, "/model/wte.weight", H5T_IEEE_F32LE, space, H5P_DEFAULT, plist, H5P_DEFAULT);
    ASSERT_GE(d, 0);
    H5Dclose(d);
    H5Pclose(plist);
    H5Sclose(space);
  });
  const std::string msg = load_error();
  EXPECT_NE(msg.find("/model/wte.weight: declares 1099511627776 values but the file does not "
                     "store them all"),
            std::string::npos)
      << msg;
}

TEST_F(CheckpointTest, WrongDtypeOrRankIsNamed) {
  struct Case {
    const char* path;
    hid_t type;
    std::vector<hsize_t> dims;
    const char* expect;
  };
  const std::vector<Case> cases = {
      {"/tokenizer/vocab", H5T_IEEE_F32LE, {6}, "/tokenizer/vocab: dtype float32, expected uint32"},
      {"/tokenizer/vocab", H5T_STD_I32LE, {6}, "/tokenizer/vocab: dtype int32, expected uint32"},
      {"/model/wte.weight", H5T_IEEE_F64LE, {5, 3}, "/model/wte.weight: dtype float64"},
      {"/train/rng_state", H5T_STD_U64LE, {5, 1}, "/train/rng_state: rank 2, expected 1"},
      {"/optimizer/v/wte.weight",
       H5T_IEEE_F32LE,
       {3, 5},
       "/optimizer/v/wte.weight: shape (3, 5), /model/wte.weight has (5, 3)"},
  };
  for (const Case& c : cases) {
    save_checkpoint(file_, sample_checkpoint());
    edit_file([&](hid_t f) { replace_dataset(f, c.path, c.type, c.dims); });
    const std::string msg = load_error();
    EXPECT_NE(msg.find(file_.string()), std::string::npos) << msg;
    EXPECT_NE(msg.find(c.expect), std::string::npos) << msg;
  }
  // A group where a dataset belongs, and a config attribute of an unsupported type.
  save_checkpoint(file_, sample_checkpoint());
  edit_file([](hid_t f) {
    ASSERT_GE(H5Ldelete(f, "/tokenizer/vocab", H5P_DEFAULT), 0);
    H5Gclose(H5Gcreate2(f, "/tokenizer/vocab", H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT));
  });
  EXPECT_NE(load_error().find("/tokenizer/vocab is not a dataset"), std::string::npos);
  save_checkpoint(file_, sample_checkpoint());
  edit_file([](hid_t f) {
    const hsize_t n = 3;
    const hid_t space = H5Screate_simple(1, &n, nullptr);
    const hid_t config = H5Gopen2(f, "/config", H5P_DEFAULT);
    H5Aclose(H5Acreate2(config, "dims", H5T_STD_I64LE, space, H5P_DEFAULT, H5P_DEFAULT));
    H5Gclose(config);
    H5Sclose(space);
  });
  EXPECT_NE(load_error().find("attribute 'dims' of /config: expected a single value"),
            std::string::npos);
}

TEST_F(CheckpointTest, CheckModelShapes) {
  const Checkpoint c = sample_checkpoint();
  std::vector<std::pair<std::string, std::vector<int64_t>>> expected;
  for (const auto& [name, a] : c.model) expected.emplace_back(name, a.shape);
  EXPECT_NO_THROW(check_model_shapes(c, expected, file_));

  auto wrong = expected;
  wrong[1].second = {3, 4};
  std::string msg = error_of([&] { check_model_shapes(c, wrong, file_); });
  EXPECT_NE(msg.find(file_.string()), std::string::npos) << msg;
  EXPECT_NE(msg.find("/model/blocks.0.attn.q_proj.weight: shape (3, 3) in the file, the model "
                     "expects (3, 4)"),
            std::string::npos)
      << msg;

  wrong = expected;
  wrong.emplace_back("blocks.1.attn.q_proj.weight", std::vector<int64_t>{3, 3});
  msg = error_of([&] { check_model_shapes(c, wrong, file_); });
  EXPECT_NE(msg.find("missing dataset /model/blocks.1.attn.q_proj.weight"), std::string::npos)
      << msg;

  wrong = expected;
  wrong.pop_back();
  msg = error_of([&] { check_model_shapes(c, wrong, file_); });
  EXPECT_NE(msg.find("unexpected dataset /model/a_head.weight"), std::string::npos) << msg;

  // A dataset deleted from the file is caught here, by name.
  save_checkpoint(file_, c);
  edit_file([](hid_t f) {
    ASSERT_GE(H5Ldelete(f, "/model/blocks.0.ln_1.weight", H5P_DEFAULT), 0);
    ASSERT_GE(H5Ldelete(f, "/optimizer", H5P_DEFAULT), 0);
  });
  msg = error_of([&] { check_model_shapes(load_checkpoint(file_), expected, file_); });
  EXPECT_NE(msg.find(file_.string()), std::string::npos) << msg;
  EXPECT_NE(msg.find("missing dataset /model/blocks.0.ln_1.weight"), std::string::npos) << msg;
}

std::string shell_quote(const std::string& s) { return "'" + s + "'"; }

TEST_F(CheckpointTest, H5pyLoadsIntoTorchLinear) {
  const std::string python = KVLAB_PYTHON3;
  const int probe =
      std::system((shell_quote(python) + " -c 'import h5py, torch' >/dev/null 2>&1").c_str());
  ASSERT_TRUE(WIFEXITED(probe) && WEXITSTATUS(probe) == 0)
      << python << " cannot import h5py and torch: run scripts/setup.sh --tests (Debian packages "
      << "python3-h5py and python3-torch)";

  const int n_in = 3, n_out = 2;
  Checkpoint c;
  c.config = {
      {"n_in", int64_t{n_in}}, {"n_out", int64_t{n_out}}, {"name", std::string("h\xc3\xa9llo")}};
  c.tokenizer_kind = "byte";
  ArrayF32 w = ramp({n_out, n_in}, -0.75f);  // (out, in), as torch.nn.Linear
  w.data[0] = 0.1f;                          // not exactly representable: bits must match
  const ArrayF32 b = ramp({n_out}, 0.125f);
  c.model = {{"proj.weight", w}, {"proj.bias", b}};
  save_checkpoint(file_, c);

  const fs::path script = fs::path(KVLAB_SOURCE_DIR) / "tests/checkpoints/load_with_h5py.py";
  const fs::path out = dir_ / "out.txt", err = dir_ / "err.txt";
  const std::string cmd = shell_quote(python) + " " + shell_quote(script) + " " +
                          shell_quote(file_) + " >" + shell_quote(out) + " 2>" + shell_quote(err);
  const int rc = std::system(cmd.c_str());
  ASSERT_TRUE(WIFEXITED(rc) && WEXITSTATUS(rc) == 0) << cmd << "\n" << read_text(err);

  std::istringstream lines(read_text(out));
  std::string key, name;
  lines >> key >> name;
  EXPECT_EQ(key, "name");
  EXPECT_EQ(name, "h\xc3\xa9llo");
  lines >> key;
  EXPECT_EQ(key, "weight_bits");
  for (float v : w.data) {
    std::string hex;
    lines >> hex;
    EXPECT_EQ(std::stoul(hex, nullptr, 16), std::bit_cast<uint32_t>(v)) << hex;
  }
  lines >> key;
  EXPECT_EQ(key, "y");
  for (int o = 0; o < n_out; ++o) {
    double expect = b.data[o];
    for (int i = 0; i < n_in; ++i) expect += double(w.data[o * n_in + i]) * (i + 1);
    double got = NAN;
    lines >> got;
    EXPECT_NEAR(got, expect, 1e-5) << "y[" << o << "]";
  }
  EXPECT_TRUE(lines) << read_text(out);
}

}  // namespace
}  // namespace kvlab
