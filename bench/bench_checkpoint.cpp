// What the checkpoint's protections cost: save (with its digest) and load of a kvlab file
// (digest checked, then parsed in this process) and of the same file without the digest (parsed
// first in a child process, then here), against reading the same datasets with plain HDF5 calls
// (the loader before the protections), samples interleaved. Also the CRC-32 alone.
#include <hdf5.h>
#include <zlib.h>

#include <CLI/CLI.hpp>
#include <filesystem>
#include <fstream>
#include <iostream>

#include "bench/bench_util.h"
#include "checkpoints/model_io.h"

using namespace kvlab;
namespace fs = std::filesystem;

namespace {

// Every float dataset under /model, /optimizer/m and /optimizer/v, each read by path through
// the default file driver into a vector of its own, as the loader did before: the baseline.
std::vector<std::vector<float>> read_plain(const fs::path& file,
                                           const std::vector<std::string>& datasets) {
  const hid_t f = H5Fopen(file.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
  std::vector<std::vector<float>> arrays;
  for (const std::string& path : datasets) {
    const hid_t d = H5Dopen2(f, path.c_str(), H5P_DEFAULT);
    const hid_t s = H5Dget_space(d);
    arrays.emplace_back(static_cast<size_t>(H5Sget_simple_extent_npoints(s)));
    H5Dread(d, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, arrays.back().data());
    H5Sclose(s);
    H5Dclose(d);
  }
  H5Fclose(f);
  return arrays;
}

std::string read_all(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Checkpoint save/load cost of the digest and the checking child process"};
  GPTConfig cfg;
  cfg.vocab_size = 256;
  cfg.block_size = 512;
  cfg.n_layer = 6;
  cfg.n_head = 8;
  cfg.n_kv_head = 8;
  cfg.n_embd = 256;
  int reps = 7;
  std::string dir = "out/bench-checkpoint", json_path;
  app.add_option("--n-layer", cfg.n_layer);
  app.add_option("--n-head", cfg.n_head);
  app.add_option("--n-kv-head", cfg.n_kv_head);
  app.add_option("--n-embd", cfg.n_embd);
  app.add_option("--block-size", cfg.block_size);
  app.add_option("--reps", reps, "Timed samples of each (median reported)");
  app.add_option("--dir", dir, "Folder for the files");
  app.add_option("--json", json_path, "Write the results as JSON here");
  CLI11_PARSE(app, argc, argv);

  const bench::Json machine = bench::machine_info();
  bench::print_machine(machine);
  GPT model(cfg, 1);
  Checkpoint ckpt;
  put_gpt_config(ckpt.config, cfg);
  std::vector<uint32_t> vocab(256);
  for (uint32_t i = 0; i < 256; ++i) vocab[i] = i;
  ckpt.tokenizer_kind = "byte";
  ckpt.tokenizer_vocab = vocab;
  ckpt.model = to_arrays(model.named_parameters());
  ckpt.has_optimizer = true;
  ckpt.optimizer_m = ckpt.model;
  ckpt.optimizer_v = ckpt.model;
  ckpt.has_train_state = true;
  ckpt.rng_state = {1, 2, 3, 4, 5, 6, 7, 8};
  std::vector<std::string> datasets;
  for (const char* group : {"/model/", "/optimizer/m/", "/optimizer/v/"})
    for (const auto& [name, arr] : ckpt.model) datasets.push_back(group + name);

  fs::create_directories(dir);
  const fs::path sealed = fs::path(dir) / "sealed.h5", foreign = fs::path(dir) / "foreign.h5";
  save_checkpoint(sealed, ckpt);
  const std::string bytes = read_all(sealed);
  std::ofstream(foreign, std::ios::binary) << bytes.substr(512);
  const LoadOptions resume = gpt_load_options(sealed, true);

  const bench::TimerOptions opt{.reps = reps, .warmup = 1, .min_sample_s = 0};
  const auto t = bench::time_interleaved(
      {[&] { bench::keep(read_plain(sealed, datasets)); },
       [&] { bench::keep(load_checkpoint(sealed, resume)); },
       [&] { bench::keep(load_checkpoint(foreign, gpt_load_options(foreign, true))); },
       [&] {
         bench::keep(crc32_z(0, reinterpret_cast<const Bytef*>(bytes.data()), bytes.size()));
       },
       [&] { save_checkpoint(sealed, ckpt); }},
      opt);
  const double mb = static_cast<double>(bytes.size()) / 1e6;
  bench::Table table("checkpoint of " + std::to_string(count_parameters(cfg)) +
                         " parameters with AdamW moments: " + bench::fmt(mb, 1) + " MB",
                     {"operation", "ms (median)", "MB/s", "vs plain HDF5 read"});
  const char* names[] = {"plain HDF5 read (baseline)", "load, kvlab file (digest)",
                         "load, file without digest (child)", "CRC-32 alone", "save (with digest)"};
  bench::Json results = bench::Json::object();
  for (size_t i = 0; i < t.size(); ++i) {
    table.add_row({names[i], bench::fmt(1e3 * t[i].median_s, 1),
                   bench::fmt(mb / t[i].median_s, 0),
                   i == 4 ? "-" : bench::fmt(t[i].median_s / t[0].median_s, 2) + "x"});
    results[names[i]] = t[i].json();
  }
  table.print();
  if (!json_path.empty()) {
    bench::write_json(json_path, {{"machine", machine},
                                  {"bytes", bytes.size()},
                                  {"parameters", count_parameters(cfg)},
                                  {"results", results}});
  }
  return 0;
}
