#include <gtest/gtest.h>
#include <unistd.h>

#include <array>
#include <cmath>
#include <filesystem>
#include <fstream>

#include "apps/ablate/ablate.h"
#include "platform/kv_rows.h"
#include "tests/test_dir.h"
#include "train/output_dir.h"

namespace kvlab {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

class AblateTest : public testing::TestDirFixture {
 protected:
  AblateTest() : TestDirFixture("kvlab_ablate") {}
  void SetUp() override {
    TestDirFixture::SetUp();
    std::ofstream f(dir_ / "corpus.txt");
    for (int i = 0; i < 300; ++i) f << "and the king said unto them, go " << (i % 5) << " ways.\n";
  }

  AblateConfig config(const std::string& out = "out") const {
    AblateConfig c;
    c.base.corpus = (dir_ / "corpus.txt").string();
    c.base.model.n_layer = 1;
    c.base.model.n_head = 4;
    c.base.model.n_embd = 16;
    c.base.model.block_size = 16;
    c.base.batch_size = 4;
    c.base.iters = 12;
    c.base.warmup = 2;
    c.base.eval_interval = 6;
    c.base.eval_iters = 2;
    c.kv_heads = {4, 2, 1};
    c.seeds = 2;
    c.sample_tokens = 8;
    c.bench_runs = 1;
    c.out_dir = (dir_ / out).string();
    return c;
  }

  // plan_ablation(c) fails with a message containing `needle`, before any run is written.
  static void expect_error(AblateConfig c, const std::string& needle) {
    try {
      plan_ablation(c);
      FAIL() << "no error for " << needle;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
    EXPECT_FALSE(fs::exists(fs::path(c.out_dir) / "runs"));
  }
};

TEST_F(AblateTest, QuickSweepEndToEndInvariants) {
  AblateStats stats;
  const auto r = run_ablation(config(), &stats);
  EXPECT_EQ(stats.runs_total, 6);
  EXPECT_EQ(stats.steps_trained, 6 * 12);
  ASSERT_EQ(r["variants"].size(), 3u);
  const auto& mha = r["variants"][0];
  EXPECT_EQ(mha["n_kv_head"], 4);
  for (const auto& v : r["variants"]) {
    const int64_t nkv = v["n_kv_head"];
    EXPECT_EQ(v["cache_bytes_context_measured"], v["cache_bytes_context_formula"]);
    // 2 * L * B * S * NKV * HS * 4 with L = 1, B = 1, S = 16, HS = 4
    EXPECT_EQ(v["cache_bytes_context_formula"].get<int64_t>(), 2 * 1 * 1 * 16 * nkv * 4 * 4);
    EXPECT_DOUBLE_EQ(v["vs_mha"].get<double>(), static_cast<double>(nkv) / 4.0);
    EXPECT_TRUE(std::isfinite(v["val_loss_mean"].get<double>()));
    EXPECT_GE(v["val_loss_std"].get<double>(), 0.0);
    ASSERT_EQ(v["runs"].size(), 2u);
    for (const auto& run : v["runs"]) EXPECT_GE(run["curve"].size(), 3u);  // steps 0, 6, 12
    ASSERT_FALSE(v["samples"].empty());
    for (const auto& s : v["samples"]) {
      EXPECT_FALSE(s["greedy"].get<std::string>().empty());
      EXPECT_FALSE(s["sampled"].get<std::string>().empty());
    }
    EXPECT_GT(v["decode_tokens_per_s_cache"].get<double>(), 0.0);
    // The serving sweep: the first variant's rates for every variant, two runs at each, and
    // the sustained rate one of them (or 0).
    const auto& sweep = v["serve_sweep"];
    ASSERT_EQ(sweep.size(), 5u);
    bool sustained_is_a_rate = v["serve_sustained_rate"].get<double>() == 0;
    for (size_t k = 0; k < sweep.size(); ++k) {
      EXPECT_EQ(sweep[k]["rate"], mha["serve_sweep"][k]["rate"]);
      ASSERT_EQ(sweep[k]["requests_per_s"].size(), 2u);
      ASSERT_EQ(sweep[k]["ttft_p99_ms"].size(), 2u);
      for (const auto& x : sweep[k]["requests_per_s"]) EXPECT_GT(x.get<double>(), 0.0);
      sustained_is_a_rate |= sweep[k]["rate"] == v["serve_sustained_rate"];
    }
    EXPECT_TRUE(sustained_is_a_rate) << v["serve_sustained_rate"];
    // Every cache dtype of the default list, every seed: the f32 cache against itself is
    // exact, the others cost something, and bytes per token are the formula's (HS 4: int4
    // rows are one group, 2 bytes of codes and 4 of scale and minimum).
    const auto& quality = v["kv_quality"];
    ASSERT_EQ(quality.size(), 5u);
    const std::vector<std::pair<std::string, int64_t>> row{
        {"f32", 16}, {"bf16", 8}, {"fp8", 4}, {"int8", 8}, {"int4", 6}};
    for (size_t d = 0; d < row.size(); ++d) {
      EXPECT_EQ(quality[d]["dtype"], row[d].first);
      EXPECT_EQ(quality[d]["bytes_per_token"].get<int64_t>(), 2 * 1 * nkv * row[d].second);
      EXPECT_EQ(quality[d]["kl_seeds"].size(), 2u);
      EXPECT_GE(quality[d]["kl_mean"].get<double>(), 0.0);
    }
    EXPECT_EQ(quality[0]["kl_mean"].get<double>(), 0.0);
    EXPECT_EQ(quality[0]["top1_mean"].get<double>(), 1.0);
    EXPECT_GT(quality[4]["kl_mean"].get<double>(), quality[3]["kl_mean"].get<double>());
    // The default matrix types, every seed, on the same windows. At n_embd 16 only the MLP's
    // output matrix has rows of whole 32-value blocks: q8_0 and q4_0 round it alone (the
    // ordering of every type's cost and bytes is the bpe sweep's, at n_embd 32).
    const auto& weights = v["weight_quality"];
    ASSERT_EQ(weights.size(), 3u);
    const int64_t f32_bytes = v["decode_weight_bytes_f32"];
    for (size_t d = 0; d < weights.size(); ++d) {
      EXPECT_EQ(weights[d]["dtype"], (std::array{"bf16", "q8_0", "q4_0"}[d]));
      EXPECT_EQ(weights[d]["positions"], quality[0]["positions"]);
      EXPECT_EQ(weights[d]["kl_seeds"].size(), 2u);
      EXPECT_GT(weights[d]["kl_mean"].get<double>(), 0.0);
      EXPECT_LT(weights[d]["top1_mean"].get<double>(), 1.0 + 1e-12);
      EXPECT_LT(weights[d]["decode_weight_bytes"].get<int64_t>(), f32_bytes);
    }
    EXPECT_GT(weights[2]["kl_mean"].get<double>(), weights[1]["kl_mean"].get<double>());
    EXPECT_LT(weights[2]["decode_weight_bytes"].get<int64_t>(),
              weights[1]["decode_weight_bytes"].get<int64_t>());
  }
  // Generation quality: each seed's variants paired on the same windows, MHA the reference.
  const auto& gq = r["generation_quality"];
  EXPECT_EQ(gq["reference"], "kv4");
  ASSERT_EQ(gq["variants"].size(), 3u);
  ASSERT_EQ(gq["pairs"].size(), 3u);  // every pair of three
  EXPECT_EQ(gq["variants"][0]["kl_vs_reference"], json({0.0, 0.0}));
  EXPECT_EQ(gq["variants"][0]["top1_vs_reference"], json({1.0, 1.0}));
  for (const auto& v : gq["variants"]) {
    ASSERT_EQ(v["loss"].size(), 2u);  // a figure per seed
    EXPECT_GT(v["bits_per_byte"][0].get<double>(), 0.0);
    EXPECT_FALSE(v["position_buckets"].empty());
    EXPECT_FALSE(v["recall"].empty());
  }
  for (const auto& p : gq["pairs"]) {
    ASSERT_EQ(p["seeds"].size(), 2u);
    for (const auto& s : p["seeds"])
      EXPECT_LE(s["ci95"][0].get<double>(), s["ci95"][1].get<double>());
  }
  for (const char* f : {"results.json", "results.csv", "report.md", "report.html",
                        "val_loss_curves.svg", "val_loss_curves_vs_mha.svg", "val_loss_vs_kv.svg", "cache_bytes_vs_kv.svg",
                        "tokens_per_s_vs_kv.svg", "served_vs_rate.svg", "ttft_p99_vs_rate.svg",
                        "val_loss_vs_cache_bytes.svg", "kl_vs_cache_bytes.svg",
                        "loss_by_position.svg", "recall_by_distance.svg"})
    EXPECT_TRUE(fs::exists(dir_ / "out" / f)) << f;
  std::ifstream md(dir_ / "out" / "report.md");
  const std::string report((std::istreambuf_iterator<char>(md)), std::istreambuf_iterator<char>());
  EXPECT_NE(report.find("## Generation quality: paired on shared windows"), std::string::npos);
  EXPECT_NE(report.find("the paired bootstrap tells "), std::string::npos);
  EXPECT_LT(report.find("## What each cache dtype costs"),
            report.find("## What each weight dtype costs"));
  EXPECT_NE(report.find("## What each weight dtype costs"), std::string::npos);
  EXPECT_NE(report.find("- q8_0 matrices cost n_kv_head=4 (MHA) "), std::string::npos);
  // The findings open the report: MHA's two fewer-head variants against it.
  EXPECT_LT(report.find("## Findings"), report.find("## Loss, cache and speed"));
  EXPECT_NE(report.find("- n_kv_head=2 (GQA): val loss "), std::string::npos);
  EXPECT_NE(report.find("- n_kv_head=1 (MQA): val loss "), std::string::npos);
}

// A bpe sweep learns its vocabulary once (the token cache) and reports bits per byte of the
// validation text and cache bytes per byte of text beside the per-token figures.
TEST_F(AblateTest, BpeSweepReportsBitsPerByte) {
  AblateConfig c = config();
  c.base.tokenizer = "bpe";
  c.base.model.vocab_size = 280;
  c.kv_heads = {4, 1};
  c.seeds = 1;
  c.kv_dtypes = {};
  c.base.model.n_embd = 32;  // every matrix's rows whole q8_0/q4_0 blocks of 32
  c.weight_dtypes = {WeightDtype::Q4_0, WeightDtype::F32, WeightDtype::Q8_0, WeightDtype::BF16};
  c.weight_dtype = WeightDtype::Q8_0;  // the model served and benchmarked; quality starts at f32
  c.int8_products = true;  // served so, and q8_0 and q4_0 scored so
  const auto r = run_ablation(c);
  ASSERT_EQ(r["variants"].size(), 2u);
  EXPECT_EQ(r["weight_dtype"], "q8_0");
  EXPECT_EQ(r["int8_products"], true);
  // The matrix types, as listed: f32 against itself is exact; each smaller type costs more
  // (KL) for fewer bytes than the one before it.
  for (const auto& v : r["variants"]) {
    const auto& w = v["weight_quality"];
    ASSERT_EQ(w.size(), 4u);
    const auto at = [&](const char* dtype) {
      for (const auto& e : w)
        if (e["dtype"] == dtype) return e;
      ADD_FAILURE() << "no " << dtype;
      return json();
    };
    EXPECT_EQ(w[0]["dtype"], "q4_0");
    for (const char* d : {"q8_0", "q4_0"}) EXPECT_EQ(at(d)["int8_products"], true) << d;
    for (const char* d : {"f32", "bf16"}) EXPECT_EQ(at(d)["int8_products"], false) << d;
    EXPECT_EQ(at("f32")["kl_mean"].get<double>(), 0.0);
    EXPECT_EQ(at("f32")["delta_loss_mean"].get<double>(), 0.0);
    EXPECT_EQ(at("f32")["top1_mean"].get<double>(), 1.0);
    EXPECT_EQ(at("f32")["decode_weight_bytes"], v["decode_weight_bytes_f32"]);
    const char* order[] = {"f32", "bf16", "q8_0", "q4_0"};
    for (int i = 1; i < 4; ++i) {
      EXPECT_GT(at(order[i])["kl_mean"].get<double>(), at(order[i - 1])["kl_mean"].get<double>())
          << order[i];
      EXPECT_LT(at(order[i])["decode_weight_bytes"].get<int64_t>(),
                at(order[i - 1])["decode_weight_bytes"].get<int64_t>())
          << order[i];
    }
  }
  for (const auto& v : r["variants"]) {
    const double loss = v["val_loss_mean"], bpb = v["val_bpb_mean"];
    const double tokens_per_byte = v["val_tokens_per_byte"];
    EXPECT_GT(tokens_per_byte, 0.0);
    EXPECT_LT(tokens_per_byte, 0.5);  // merged: several bytes a token
    EXPECT_NEAR(bpb, loss * tokens_per_byte / std::log(2.0), 1e-9);
    EXPECT_NEAR(v["cache_bytes_per_byte"].get<double>(),
                v["cache_bytes_per_token"].get<double>() * tokens_per_byte, 1e-9);
    EXPECT_NEAR(v["runs"][0]["curve"].back()["val_bpb"].get<double>(), bpb, 1e-9);
  }
  std::ifstream md(dir_ / "out" / "report.md");
  const std::string report{std::istreambuf_iterator<char>(md), {}};
  EXPECT_NE(report.find("bits/byte"), std::string::npos);
  EXPECT_NE(report.find("cache bytes/byte"), std::string::npos);
  EXPECT_NE(report.find("in integer products (--int8-products)"), std::string::npos);
  EXPECT_NE(report.find("q4_0+int8"), std::string::npos);
  EXPECT_NE(report.find("q8_0+int8 matrices cost"), std::string::npos);
  int bpe_caches = 0;  // one vocabulary for every run
  for (const auto& e : fs::directory_iterator(dir_))
    bpe_caches += e.path().string().ends_with(".bpe-280-kvlab-val0.1.kvlab-cache");
  EXPECT_EQ(bpe_caches, 1);
}

TEST_F(AblateTest, ResumeRetrainsNothingThatFinished) {
  AblateConfig c = config();
  c.kv_heads = {2, 1};
  c.seeds = 1;
  run_ablation(c);
  // One run is lost, another is half-finished (stopped at step 5).
  fs::remove_all(dir_ / "out" / "runs" / "kv1_seed0");
  std::vector<TrainConfig> plan = plan_ablation(c);
  {
    Trainer t(plan[1]);
    t.run([](const StepRecord& r) { return r.step < 5; });
  }
  AblateStats stats;
  run_ablation(c, &stats);
  EXPECT_EQ(stats.runs_reused, 1);
  EXPECT_EQ(stats.runs_resumed, 1);
  EXPECT_EQ(stats.steps_trained, 12 - 5);
  // And again: everything is reused.
  run_ablation(c, &stats);
  EXPECT_EQ(stats.runs_reused, 2);
  EXPECT_EQ(stats.steps_trained, 0);
}

// A run stopped before its first checkpoint left only a log: the next sweep trains that run
// from scratch, its log starts over (step 0 once), and step 0, which trained nothing, has no
// training loss in results.json.
TEST_F(AblateTest, ARunFolderHoldingOnlyALogStartsOver) {
  AblateConfig c = config();
  c.kv_heads = {2};
  c.seeds = 1;
  const fs::path run = dir_ / "out" / "runs" / "kv2_seed0";
  fs::create_directories(run);
  std::ofstream(run / "log.jsonl") << "{\"step\": 0, \"val_loss\": 9.0, \"train_loss\": null}\n";
  std::ofstream(run / "last.h5.tmp-4242") << "half a checkpoint";
  AblateStats stats;
  const auto r = run_ablation(c, &stats);
  EXPECT_EQ(stats.runs_resumed, 0);
  EXPECT_EQ(stats.steps_trained, 12);
  EXPECT_FALSE(fs::exists(run / "last.h5.tmp-4242"));
  const auto& curve = r["variants"][0]["runs"][0]["curve"];
  ASSERT_EQ(curve.size(), 3u);  // steps 0, 6, 12
  EXPECT_EQ(curve[0]["step"], 0);
  EXPECT_NE(curve[0]["val_loss"], 9.0);
  EXPECT_TRUE(curve[0]["train_loss"].is_null()) << curve[0];
  EXPECT_TRUE(curve[1]["train_loss"].is_number()) << curve[1];
}

// One sweep per folder at a time: a second one refuses before anything trains, naming the
// holder.
TEST_F(AblateTest, ASecondSweepOnTheSameFolderIsRefused) {
  AblateConfig c = config();
  const OutputDirLock held(c.out_dir, "train");
  try {
    run_ablation(c);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("ablate: output folder " + c.out_dir +
                                         " is in use by another kvlab process (pid " +
                                         std::to_string(::getpid()) + ")"),
              std::string::npos)
        << e.what();
  }
  EXPECT_FALSE(fs::exists(dir_ / "out" / "runs"));
}

TEST_F(AblateTest, AChangedConfigIsAnErrorNamingTheKeys) {
  AblateConfig c = config();
  c.kv_heads = {2};
  c.seeds = 1;
  run_ablation(c);
  c.base.lr = 5e-4;
  try {
    run_ablation(c);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("lr:"), std::string::npos) << e.what();
  }
}

// Finished runs are reused only on the same text: another corpus under the same --out is an
// error naming both, before anything trains.
TEST_F(AblateTest, AnotherCorpusIsAnErrorNotAReuse) {
  AblateConfig c = config();
  c.kv_heads = {2};
  c.seeds = 1;
  run_ablation(c);
  std::ofstream(dir_ / "other.txt") << std::ifstream(dir_ / "corpus.txt").rdbuf() << "amen.\n";
  c.base.corpus = (dir_ / "other.txt").string();
  const auto log = dir_ / "out" / "runs" / "kv2_seed0" / "log.jsonl";
  const auto log_time = fs::last_write_time(log);
  try {
    run_ablation(c);
    FAIL() << "no error";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("corpus: " + (dir_ / "corpus.txt").string()), std::string::npos) << msg;
    EXPECT_NE(msg.find(" vs " + c.base.corpus), std::string::npos) << msg;
    EXPECT_NE(msg.find("another --out"), std::string::npos) << msg;
  }
  EXPECT_EQ(fs::last_write_time(log), log_time);
}

TEST_F(AblateTest, BadInputFailsBeforeTraining) {
  AblateConfig c = config();
  c.kv_heads = {4, 3};
  expect_error(c, "not divisible by n_kv_head = 3");
  c = config();
  c.kv_heads = {};
  c.base.model.n_head = 0;
  expect_error(c, "n_head");
  c = config();
  c.out_dir = "/proc/kvlab-cannot-write-here";
  expect_error(c, "not writable");
  c = config();
  c.base.model.block_size = 1 << 20;
  expect_error(c, "block");
  for (const int64_t k : {0, -2, 8}) {
    c = config();
    c.kv_heads = {4, k};
    expect_error(c, "n_kv_head = " + std::to_string(k) + " must be in [1, 4]");
  }
  c = config();
  c.kv_heads = {4, 2, 4};
  expect_error(c, "n_kv_head = 4 is listed twice");
  // The samples' prompts come after all training: they are checked first, with the engine's
  // messages.
  c = config();
  c.prompts = {"Zebra"};
  expect_error(c, "characters are not in the model's vocabulary: 'Z' (U+005A)");
  c.prompts = {"and", ""};
  expect_error(c, "prompt 2 is empty");
  c.prompts = {std::string(17, 'a')};
  expect_error(c, "prompt has 17 tokens, more than the model's context of block_size = 16");
}

// --mla-ranks: MLA variants train beside the n_kv_head ones (all with RoPE) and are measured
// the same way: their latent cache's bytes equal the formula's (L * S * (R + D) f32 values), its
// quality at every dtype, decode speed, samples and serving (the scheduler over a paged pool of
// latent rows); the report compares each with the n_kv_head variant nearest in bytes.
TEST_F(AblateTest, MlaRanksJoinTheSweep) {
  AblateConfig c = config();
  c.base.model.pos = "rope";
  c.kv_heads = {4, 1};
  c.mla_ranks = {6, 2};
  c.mla_q_lora_rank = 8;
  const auto r = run_ablation(c);
  ASSERT_EQ(r["variants"].size(), 4u);
  EXPECT_EQ(r["config"]["mla_ranks"], json({6, 2}));
  EXPECT_EQ(r["config"]["mla_rope_head_dim"], 2);  // half of head size 4
  EXPECT_EQ(r["config"]["mla_q_lora_rank"], 8);
  for (int i : {2, 3}) {
    const auto& v = r["variants"][i];
    const int64_t rank = i == 2 ? 6 : 2;
    EXPECT_EQ(v["kv_lora_rank"], rank);
    EXPECT_FALSE(v.contains("n_kv_head"));
    EXPECT_EQ(v["cache_bytes_context_measured"], v["cache_bytes_context_formula"]);
    EXPECT_EQ(v["cache_bytes_context_measured"].get<int64_t>(), 1 * 16 * (rank + 2) * 4);
    EXPECT_DOUBLE_EQ(v["vs_mha"].get<double>(), (rank + 2) / 32.0);  // MHA: 2 * 4 heads * 4
    EXPECT_TRUE(std::isfinite(v["val_loss_mean"].get<double>()));
    EXPECT_EQ(v["runs"].size(), 2u);
    EXPECT_TRUE(fs::exists(dir_ / "out" / "runs" / ("mla" + std::to_string(rank) + "_seed1") /
                           "final.h5"));
    EXPECT_GT(v["decode_tokens_per_s_cache"].get<double>(), 0.0);
    EXPECT_FALSE(v["samples"].empty());
    EXPECT_GT(v["serve_requests_per_s_continuous"].get<double>(), 0.0);
    EXPECT_GT(v["serve_peak_sequences_continuous"].get<double>(), 0.0);
    EXPECT_FALSE(v["serve_sweep"].empty());
    EXPECT_GT(v["kv_workload_peak_sequences_paged"].get<double>(), 0.0);
    const auto& quality = v["kv_quality"];
    ASSERT_EQ(quality.size(), 5u);
    const std::vector<std::pair<std::string, DType>> dtypes = {{"f32", DType::F32},
                                                               {"bf16", DType::BF16},
                                                               {"fp8", DType::FP8},
                                                               {"int8", DType::INT8},
                                                               {"int4", DType::INT4}};
    for (size_t d = 0; d < quality.size(); ++d) {
      EXPECT_EQ(quality[d]["dtype"], dtypes[d].first);
      EXPECT_EQ(quality[d]["bytes_per_token"].get<int64_t>(), kv_row_bytes(dtypes[d].second, rank + 2));
    }
    EXPECT_EQ(quality[0]["kl_mean"].get<double>(), 0.0);
  }
  const std::string md = [&] {
    std::ifstream f(dir_ / "out" / "report.md");
    return std::string(std::istreambuf_iterator<char>(f), {});
  }();
  EXPECT_NE(md.find("## MLA against GQA at equal cache bytes"), std::string::npos);
  // rank 6 + 2: 32 bytes a position against n_kv_head 1's 2 * 4 * 4 = 32.
  EXPECT_NE(md.find("At 32 against 32 cache bytes per token (1.00x): MLA kv_lora_rank=6 vs "
                    "n_kv_head=1 (MQA)"),
            std::string::npos);
}

TEST_F(AblateTest, MlaRanksTheModelCannotTakeFailBeforeTraining) {
  AblateConfig c = config();
  c.mla_ranks = {4};
  expect_error(c, "--mla-ranks: MLA needs rotary positions");
  c.base.model.pos = "rope";
  c.mla_ranks = {4, 17};
  expect_error(c, "MLA rank 17 must be in [1, n_embd = 16]");
  c.mla_ranks = {4, 4};
  expect_error(c, "MLA rank 4 is listed twice");
  c.mla_ranks = {4};
  c.mla_rope_head_dim = 3;
  expect_error(c, "MLA rank 4: config: rope_head_dim 3 must be even");
  c.mla_ranks = {};
  expect_error(c, "without --mla-ranks");
}

// --uptrain: each seed's MHA run converted to n_kv_head 2 by every method, evaluated, then
// uptrained round(F * iters) steps; a second sweep reuses every uptrain run.
TEST_F(AblateTest, UptrainConvertsEachSeedsMhaRunAndReusesFinishedRuns) {
  AblateConfig c = config();
  c.kv_heads = {4, 2};
  c.base.iters = 18;
  c.base.lr = 3e-3;
  c.kv_dtypes = {};
  c.uptrain = 0.3;  // round(5.4) = 5 steps
  const int64_t steps = 5;
  AblateStats stats;
  const auto r = run_ablation(c, &stats);
  ASSERT_TRUE(r.contains("uptrain")) << r.dump();
  const auto& u = r["uptrain"];
  EXPECT_EQ(u["steps"], steps);
  EXPECT_EQ(u["source_n_kv_head"], 4);
  EXPECT_EQ(stats.uptrain_runs_total, 3 * 2);
  EXPECT_EQ(stats.uptrain_runs_reused, 0);
  EXPECT_EQ(stats.uptrain_steps_trained, 3 * 2 * steps);
  ASSERT_EQ(u["entries"].size(), 3u);  // one n_kv_head below MHA, three methods
  const std::vector<std::string> methods = {"mean", "first", "random"};
  for (size_t m = 0; m < methods.size(); ++m) {
    const auto& e = u["entries"][m];
    EXPECT_EQ(e["n_kv_head"], 2);
    EXPECT_EQ(e["method"], methods[m]);
    EXPECT_EQ(e["uptrain_steps"], steps);
    EXPECT_EQ(e["scratch_steps"], 18);
    EXPECT_EQ(e["uptrained_steps"], 18 + steps);
    EXPECT_EQ(e["uptrained_tokens"], (18 + steps) * 4 * 16);
    // From scratch is the sweep's own n_kv_head = 2 variant.
    EXPECT_EQ(e["val_loss_scratch_mean"], r["variants"][1]["val_loss_mean"]);
    // Not parameter-matched: the converted and from-scratch models are the same shape.
    EXPECT_EQ(e["params_scratch"], r["variants"][1]["params"]);
    EXPECT_EQ(e["params_uptrained"], e["params_scratch"]);
    ASSERT_EQ(e["runs"].size(), 2u);
    for (int s = 0; s < 2; ++s) {
      const auto& run = e["runs"][s];
      EXPECT_EQ(run["seed"], c.base.seed + s);
      const auto& curve = run["curve"];
      ASSERT_EQ(curve.size(), static_cast<size_t>(steps + 1));  // every step: steps / 5 = 1
      EXPECT_EQ(curve.front()["step"], 0);
      EXPECT_EQ(curve.back()["step"], steps);
      const double conv = run["val_loss_converted"], up = run["val_loss_uptrained"];
      EXPECT_TRUE(std::isfinite(conv)) << methods[m];
      EXPECT_TRUE(std::isfinite(up)) << methods[m];
      if (methods[m] == "random") {
        EXPECT_LT(up, conv) << "seed " << s;
      }
    }
  }
  // Mean and first keep the source's keys and values: right after conversion they are far
  // closer to the MHA model than random heads are.
  EXPECT_LT(u["entries"][0]["val_loss_converted_mean"].get<double>(),
            u["entries"][2]["val_loss_converted_mean"].get<double>());
  EXPECT_TRUE(fs::exists(dir_ / "out" / "uptrain_kv2.svg"));
  std::ifstream md(dir_ / "out" / "report.md");
  const std::string text((std::istreambuf_iterator<char>(md)), {});
  EXPECT_NE(text.find("## Uptraining converted checkpoints"), std::string::npos);
  EXPECT_NE(text.find("At n_kv_head=2, right after conversion:"), std::string::npos) << text;

  AblateStats again;
  const auto r2 = run_ablation(c, &again);
  EXPECT_EQ(again.steps_trained, 0);
  EXPECT_EQ(again.uptrain_runs_reused, 6);
  EXPECT_EQ(again.uptrain_steps_trained, 0);
  EXPECT_EQ(r2["uptrain"]["entries"], u["entries"]);
}

TEST_F(AblateTest, UptrainTheSweepCannotServeFailsBeforeTraining) {
  AblateConfig c = config();
  c.uptrain = 1.5;
  expect_error(c, "--uptrain 1.5 must be a fraction of the sweep's steps in (0, 1]");
  c.uptrain = -0.1;
  expect_error(c, "--uptrain -0.1 must be");
  c.uptrain = 0.5;
  c.kv_heads = {2, 1};
  expect_error(c, "add 4 to --kv-heads");
  c.kv_heads = {4};
  expect_error(c, "needs an n_kv_head below n_head = 4");
  c.kv_heads = {4, 1};
  c.uptrain = 0.01;
  expect_error(c, "rounds to 0 steps");
}

TEST_F(AblateTest, ParamMatchedVariantsWithinOnePercentOfMha) {
  AblateConfig c = config();
  c.param_matched = true;
  const auto plan = plan_ablation(c);
  const int64_t mha = count_parameters(plan[0].model);
  for (const auto& r : plan) {
    const double off = std::abs(static_cast<double>(count_parameters(r.model) - mha)) / mha;
    EXPECT_LE(off, 0.01) << "n_kv_head " << r.model.n_kv_head;
  }
  EXPECT_GT(plan.back().model.mlp_hidden, plan.front().model.hidden());  // MQA gets a wider MLP
}

}  // namespace
}  // namespace kvlab
