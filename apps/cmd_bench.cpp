// kvlab bench: the benchmark subcommands (apps/bench/, one file each) under one command.
#include "apps/bench/bench_common.h"

namespace kvlab {

void add_bench_command(CLI::App& root) {
  CLI::App* bench = root.add_subcommand("bench", "Benchmarks");
  bench->require_subcommand(1);
  auto args = std::make_shared<bench_cli::BenchArgs>();
  bench_cli::add_generate_command(bench, args);
  bench_cli::add_kv_memory_command(bench);
  bench_cli::add_serve_command(bench);
  bench_cli::add_kv_quality_command(bench, args);
  bench_cli::add_weight_quality_command(bench, args);
}

}  // namespace kvlab
