#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <map>
#include <regex>
#include <sstream>

#include "platform/error.h"
#include "report/report.h"
#include "report/report_parts.h"
#include "tests/report/xml_check.h"
#include "tests/test_dir.h"

namespace kvlab {
namespace {

using nlohmann::json;
namespace fs = std::filesystem;

// --- synthetic results -------------------------------------------------------------------

// Sample texts carry markup characters so the HTML escaping is visible in the tests.
std::string greedy_text(int n_kv) {
  return "ROMEO:\nWhat <say> you & \"I\"? kv" + std::to_string(n_kv);
}
std::string greedy_escaped(int n_kv) {
  return "ROMEO:\nWhat &lt;say&gt; you &amp; &quot;I&quot;? kv" + std::to_string(n_kv);
}
std::string sampled_text(int n_kv) { return "O <b>Juliet</b> kv" + std::to_string(n_kv); }
std::string sampled_escaped(int n_kv) {
  return "O &lt;b&gt;Juliet&lt;/b&gt; kv" + std::to_string(n_kv);
}

// A variant of a 4-layer, head-size-32 model with float32 cache at context 64.
json make_variant(int n_kv, double mean, double std, int seeds) {
  const double per_token = 2.0 * 4 * n_kv * 32 * 4;  // K and V, L layers, NKV heads, HS, bytes
  json runs = json::array();
  for (int s = 0; s < seeds; ++s) {
    json curve = json::array();
    for (int step = 0; step <= 2000; step += 250) {
      const double loss = mean + 2.3 * std::exp(-step / 300.0) + 0.01 * (s - (seeds - 1) / 2.0);
      // As kvlab ablate writes it: step 0 trained nothing, so it has no training loss.
      curve.push_back({{"step", step},
                       {"val_loss", loss},
                       {"train_loss", step > 0 ? json(loss - 0.02) : json()}});
    }
    runs.push_back({{"seed", s},
                    {"val_loss", mean},
                    {"train_tokens_per_s", 20000.0 + 100 * s},
                    {"wall_s", 40.0},
                    {"curve", curve}});
  }
  return {{"n_kv_head", n_kv},
          {"params", 800000 - (4 - n_kv) * 16384},
          {"val_loss_mean", mean},
          {"val_loss_std", std},
          {"bpc", mean / std::log(2.0)},
          {"val_bpb_mean", mean / std::log(2.0)},  // a char run on ASCII: a token a byte
          {"cache_bytes_per_token", per_token},
          {"cache_bytes_per_byte", per_token},
          {"cache_bytes_context_measured", per_token * 64},
          {"cache_bytes_context_formula", per_token * 64},
          {"vs_mha", n_kv / 4.0},
          {"sequences_in_budget", std::floor(1073741824.0 / (per_token * 64))},
          {"decode_tokens_per_s_cache", 5000.0 + 400 * (4 - n_kv)},
          {"decode_tokens_per_s_nocache", 800.0},
          {"ttft_ms", 1.2},
          {"tpot_ms", 0.2},
          {"runs", runs},
          {"samples",
           {{{"prompt", "ROMEO:"},
             {"greedy", greedy_text(n_kv)},
             {"sampled", sampled_text(n_kv)},
             {"seed", 1}}}}};
}

struct Spec {
  int n_kv;
  double mean, std;
};

json make_results(const std::vector<Spec>& specs, int seeds, int n_head = 4) {
  json variants = json::array();
  for (const Spec& s : specs) variants.push_back(make_variant(s.n_kv, s.mean, s.std, seeds));
  return {{"command", "kvlab ablate --n-kv-heads 4,2,1 --seeds 3"},
          {"started", "2024-05-01T12:00:00Z"},
          {"wall_s", 123.4},
          {"config",
           {{"corpus", "data/corpora/tiny_shakespeare.txt"},
            {"n_layer", 4},
            {"n_head", n_head},
            {"n_embd", 128},
            {"block_size", 64},
            {"batch_size", 12},
            {"iters", 2000}}},
          {"machine", {{"cpu", "AMD EPYC (Zen 3)"}, {"threads", 2}}},
          {"versions", {{"kvlab", "0.1.0"}}},
          {"kv_budget_bytes", 1073741824},
          {"dtype_bytes", 4},
          {"param_matched", false},
          {"variants", variants}};
}

// Listed out of order: the report sorts by n_kv_head, descending.
json fixture(int seeds = 3) {
  return make_results({{2, 1.89, 0.01}, {4, 1.88, 0.01}, {1, 1.95, 0.01}}, seeds);
}

// --- helpers -----------------------------------------------------------------------------

std::string read(const fs::path& p) {
  std::ifstream is(p, std::ios::binary);
  std::ostringstream os;
  os << is.rdbuf();
  return os.str();
}

std::size_t count(const std::string& s, const std::string& what) {
  std::size_t n = 0;
  for (std::size_t i = s.find(what); i != std::string::npos; i = s.find(what, i + 1)) ++n;
  return n;
}

std::vector<std::string> lines(const std::string& s) {
  std::vector<std::string> out;
  std::istringstream is(s);
  for (std::string line; std::getline(is, line);) out.push_back(line);
  return out;
}

std::string trim(const std::string& s) {
  const auto b = s.find_first_not_of(' ');
  return b == std::string::npos ? "" : s.substr(b, s.find_last_not_of(' ') - b + 1);
}

std::vector<std::string> cells(const std::string& line) {
  std::vector<std::string> out;
  std::istringstream is(line);
  for (std::string cell; std::getline(is, cell, '|');) out.push_back(trim(cell));
  return out;
}

// CSV fields of one line, honouring double quotes.
std::vector<std::string> csv_fields(const std::string& line) {
  std::vector<std::string> out(1);
  bool quoted = false;
  for (std::size_t i = 0; i < line.size(); ++i) {
    const char c = line[i];
    if (quoted && c == '"' && i + 1 < line.size() && line[i + 1] == '"') {
      out.back() += '"';
      ++i;
    } else if (c == '"') {
      quoted = !quoted;
    } else if (c == ',' && !quoted) {
      out.emplace_back();
    } else {
      out.back() += c;
    }
  }
  return out;
}

bool on_path(const std::string& program) {
  const char* path = std::getenv("PATH");
  std::istringstream dirs(path ? path : "");
  for (std::string dir; std::getline(dirs, dir, ':');)
    if (!dir.empty() && ::access((fs::path(dir) / program).c_str(), X_OK) == 0) return true;
  return false;
}

class ReportFiles : public testing::TestDirFixture {
 protected:
  ReportFiles() : TestDirFixture("kvlab-report") {}
};

const char* kSvgs[] = {"val_loss_curves.svg", "val_loss_curves_vs_mha.svg", "val_loss_vs_kv.svg",
                       "cache_bytes_vs_kv.svg",
                       "tokens_per_s_vs_kv.svg"};

// --- verdicts ----------------------------------------------------------------------------

TEST(CompareVariants, OverlapIsNotDistinguishableSeparationIsRanked) {
  const auto v = compare_variants(fixture());
  ASSERT_EQ(v.size(), 3u);  // 4-2, 2-1 adjacent, then 4-1 against MHA
  EXPECT_EQ(v[0].a, "n_kv_head=4 (MHA)");
  EXPECT_EQ(v[0].b, "n_kv_head=2 (GQA)");
  EXPECT_EQ(v[1].a, "n_kv_head=2 (GQA)");
  EXPECT_EQ(v[1].b, "n_kv_head=1 (MQA)");
  EXPECT_EQ(v[2].a, "n_kv_head=4 (MHA)");
  EXPECT_EQ(v[2].b, "n_kv_head=1 (MQA)");

  EXPECT_FALSE(v[0].distinguishable);  // 1.88 ± 0.01 vs 1.89 ± 0.01 touch
  EXPECT_NE(v[0].text.find("not distinguishable at this budget"), std::string::npos) << v[0].text;

  EXPECT_TRUE(v[1].distinguishable);
  EXPECT_NE(v[1].text.find("n_kv_head=2 (GQA) has the lower val loss, by 0.0600"),
            std::string::npos)
      << v[1].text;
  EXPECT_NE(v[1].text.find("6.0 pooled std apart"), std::string::npos) << v[1].text;

  EXPECT_TRUE(v[2].distinguishable);
  EXPECT_NE(v[2].text.find("n_kv_head=4 (MHA) has the lower val loss, by 0.0700"),
            std::string::npos)
      << v[2].text;
}

TEST(CompareVariants, NamesTheLowerVariantWhicheverItIs) {
  const auto v = compare_variants(make_results({{4, 1.95, 0.02}, {1, 1.80, 0.01}}, 2));
  ASSERT_EQ(v.size(), 1u);
  EXPECT_TRUE(v[0].distinguishable);
  EXPECT_NE(v[0].text.find("n_kv_head=1 (MQA) has the lower val loss, by 0.1500"),
            std::string::npos)
      << v[0].text;
}

TEST(CompareVariants, TouchingIntervalsCountAsOverlap) {
  // Binary-exact values: |1.5 - 2.0| == 0.25 + 0.25.
  const auto v = compare_variants(make_results({{4, 1.5, 0.25}, {2, 2.0, 0.25}}, 2));
  ASSERT_EQ(v.size(), 1u);
  EXPECT_FALSE(v[0].distinguishable);
  const auto w = compare_variants(make_results({{4, 1.5, 0.25}, {2, 2.0, 0.2}}, 2));
  EXPECT_TRUE(w[0].distinguishable);
}

TEST(CompareVariants, OneSeedIsNeverARanking) {
  // Far apart, but with one seed there is no spread to compare against.
  const auto v = compare_variants(make_results({{4, 1.88, 0.0}, {2, 2.50, 0.0}}, 1));
  ASSERT_EQ(v.size(), 1u);
  EXPECT_FALSE(v[0].distinguishable);
  EXPECT_NE(v[0].text.find("no spread measured (1 seed): difference 0.6200 is not a ranking"),
            std::string::npos)
      << v[0].text;
}

TEST(CompareVariants, OneSeedOnEitherSideIsEnough) {
  json r = fixture(3);
  json& runs = r["variants"][2]["runs"];  // n_kv_head=1 keeps one run
  runs = json::array({runs[0]});
  const auto v = compare_variants(r);
  EXPECT_NE(v[0].text.find("not distinguishable"), std::string::npos);
  EXPECT_NE(v[1].text.find("no spread measured (1 seed)"), std::string::npos) << v[1].text;
  EXPECT_NE(v[2].text.find("no spread measured (1 seed)"), std::string::npos) << v[2].text;
}

TEST(CompareVariants, AdjacentPairsThenEachAgainstMha) {
  const auto v = compare_variants(
      make_results({{1, 2.0, 0.01}, {8, 1.9, 0.01}, {2, 1.95, 0.01}, {4, 1.92, 0.01}}, 2, 8));
  std::vector<std::pair<std::string, std::string>> pairs;
  for (const Verdict& x : v) pairs.emplace_back(x.a, x.b);
  const std::string mha = "n_kv_head=8 (MHA)", g4 = "n_kv_head=4 (GQA)", g2 = "n_kv_head=2 (GQA)",
                    mqa = "n_kv_head=1 (MQA)";
  const std::vector<std::pair<std::string, std::string>> expected = {
      {mha, g4}, {g4, g2}, {g2, mqa}, {mha, g2}, {mha, mqa}};
  EXPECT_EQ(pairs, expected);
}

// --- MLA beside the n_kv_head variants ------------------------------------------------------

// An MLA variant of the fixture's model (4 layers, f32): a latent of `rank` plus a rotary key of
// 8 values per layer and position, listed first to show that the report orders it last.
json make_mla_variant(int rank, double mean, double std, int seeds) {
  json v = make_variant(4, mean, std, seeds);
  v.erase("n_kv_head");
  const double per_token = 4.0 * (rank + 8) * 4, mha = 2.0 * 4 * 4 * 32 * 4;
  v["kv_lora_rank"] = rank;
  v["rope_head_dim"] = 8;
  v["cache_bytes_per_token"] = per_token;
  v["cache_bytes_context_measured"] = per_token * 64;
  v["cache_bytes_context_formula"] = per_token * 64;
  v["vs_mha"] = per_token / mha;
  v["decode_tokens_per_s_cache"] = 1500.0;
  v["samples"][0]["greedy"] = "mla greedy " + std::to_string(rank);
  return v;
}

// The fixture (n_kv_head 4, 2, 1: 4096, 2048, 1024 bytes per token) with MLA at rank 56
// (1024 bytes: n_kv_head 1's exactly) and rank 120 (2048: n_kv_head 2's), listed first.
json mla_fixture() {
  json r = fixture(3);
  json variants = json::array({make_mla_variant(56, 1.90, 0.01, 3), make_mla_variant(120, 1.85, 0.01, 3)});
  for (const json& v : r["variants"]) variants.push_back(v);
  r["variants"] = variants;
  return r;
}

TEST(CompareVariants, EachMlaVariantAgainstTheNearestBytesThenMha) {
  const auto v = compare_variants(mla_fixture());
  ASSERT_EQ(v.size(), 3u + 4u);  // the n_kv_head ones; rank 120 vs 2 and MHA; rank 56 vs 1 and MHA
  const std::vector<std::pair<std::string, std::string>> mla = {
      {"MLA kv_lora_rank=120", "n_kv_head=2 (GQA)"},
      {"MLA kv_lora_rank=120", "n_kv_head=4 (MHA)"},
      {"MLA kv_lora_rank=56", "n_kv_head=1 (MQA)"},
      {"MLA kv_lora_rank=56", "n_kv_head=4 (MHA)"}};
  for (size_t i = 0; i < mla.size(); ++i) {
    EXPECT_EQ(v[3 + i].a, mla[i].first) << i;
    EXPECT_EQ(v[3 + i].b, mla[i].second) << i;
  }
  // 1.85 ± 0.01 against n_kv_head 2's 1.89 ± 0.01: beyond the spread; 1.90 against 1.95 too.
  EXPECT_TRUE(v[3].distinguishable);
  EXPECT_NE(v[3].text.find("MLA kv_lora_rank=120 has the lower val loss, by 0.0400"),
            std::string::npos) << v[3].text;
  EXPECT_NE(v[5].text.find("MLA kv_lora_rank=56 has the lower val loss, by 0.0500"),
            std::string::npos) << v[5].text;
  // A tie in bytes goes to the fewer: 1536 bytes (rank 88) is 512 from both 2 and 1.
  json tie = fixture(3);
  tie["variants"].push_back(make_mla_variant(88, 1.9, 0.01, 3));
  EXPECT_EQ(compare_variants(tie)[3].b, "n_kv_head=1 (MQA)");
}

TEST(FormatTable, MlaRowsAndTheEqualBytesComparison) {
  const std::string out = format_table(mla_fixture());
  const auto ls = lines(out);
  EXPECT_EQ(cells(ls[0])[0], "n_kv_head / MLA rank");
  std::vector<std::string> ids;
  for (size_t i = 2; i < 7; ++i) ids.push_back(cells(ls[i])[0]);
  EXPECT_EQ(ids, (std::vector<std::string>{"4", "2", "1", "MLA 120", "MLA 56"}));
  EXPECT_EQ(cells(ls[5])[1], "128 KiB");  // 2048 bytes a position, 64 positions
  EXPECT_NE(out.find("MLA against GQA at equal cache bytes:"), std::string::npos) << out;
  EXPECT_NE(out.find("At 2048 against 2048 cache bytes per token (1.00x): MLA kv_lora_rank=120 vs "
                     "n_kv_head=2 (GQA): MLA kv_lora_rank=120 has the lower val loss"),
            std::string::npos) << out;
  // The decode speeds side by side: 1500 against n_kv_head 1's 6200.
  const auto row = std::find_if(ls.begin(), ls.end(), [](const std::string& l) {
    const auto c = cells(l);
    return !c.empty() && c[0] == "56";
  });
  ASSERT_NE(row, ls.end()) << out;
  const auto c = cells(*row);
  EXPECT_EQ(c[2], "1 (MQA)");
  EXPECT_EQ(c[4], "1.00x");
  EXPECT_EQ(c[9], "0.24x");
}

TEST_F(ReportFiles, MlaIsInEveryPlotAndPage) {
  write_report(mla_fixture(), dir_);
  for (const char* name : kSvgs) {
    const std::string svg = read(dir_ / name);
    EXPECT_EQ(test::xml_problem(svg), "") << name;
    if (std::string(name) != "val_loss_curves.svg") {
      EXPECT_NE(svg.find("MLA"), std::string::npos) << name;
    }
  }
  // The loss plot: error bars for all five variants, the MLA ones on a series of their own.
  EXPECT_EQ(count(read(dir_ / "val_loss_vs_kv.svg"), "class=\"err\""), 5u);
  EXPECT_NE(read(dir_ / "val_loss_curves.svg").find("MLA kv_lora_rank=56"), std::string::npos);
  const std::string md = read(dir_ / "report.md");
  EXPECT_NE(md.find("# kvlab ablate: MHA vs GQA vs MQA vs MLA"), std::string::npos);
  EXPECT_NE(md.find("## MLA against GQA at equal cache bytes"), std::string::npos);
  EXPECT_NE(md.find("mla greedy 56"), std::string::npos);
  const auto csv = lines(read(dir_ / "results.csv"));
  ASSERT_EQ(csv.size(), 6u);
  const auto header = csv_fields(csv[0]);
  const auto col = [&](const std::string& name) {
    return static_cast<size_t>(std::find(header.begin(), header.end(), name) - header.begin());
  };
  ASSERT_LT(col("kv_lora_rank"), header.size());
  EXPECT_EQ(csv_fields(csv[4])[col("kv_lora_rank")], "120");
  EXPECT_EQ(csv_fields(csv[4])[col("n_kv_head")], "");
  EXPECT_EQ(csv_fields(csv[4])[col("attention")], "MLA");
  EXPECT_NE(read(dir_ / "report.html").find("MLA against GQA at equal cache bytes"),
            std::string::npos);
}

TEST(CompareVariants, BadDocumentsThrowKvlabError) {
  EXPECT_THROW(compare_variants(json::object()), Error);
  EXPECT_THROW(compare_variants(json::array()), Error);
  EXPECT_THROW(compare_variants(json{{"variants", json::array()}}), Error);
  json r = fixture();
  r["variants"][1].erase("val_loss_mean");
  try {
    compare_variants(r);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("n_kv_head=4"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("val_loss_mean"), std::string::npos) << e.what();
  }
  json dup = fixture();
  dup["variants"][0]["n_kv_head"] = 4;
  EXPECT_THROW(compare_variants(dup), Error);
  json neither = fixture();
  neither["variants"][0].erase("n_kv_head");
  EXPECT_THROW(compare_variants(neither), Error);
  neither["variants"][0]["kv_lora_rank"] = 0;
  EXPECT_THROW(compare_variants(neither), Error);
}

// --- terminal table ----------------------------------------------------------------------

TEST(FormatTable, OneRowPerVariantInOrderWithTheExactHeader) {
  const auto out = lines(format_table(fixture()));
  ASSERT_GE(out.size(), 12u);
  const std::vector<std::string> header = {
      "n_kv_head", "cache bytes (measured)", "formula", "vs MHA", "tokens/s", "val loss",
      "Δ val loss vs MHA", "bits/byte"};
  EXPECT_EQ(cells(out[0]), header);
  EXPECT_EQ(out[1].find_first_not_of("-+"), std::string::npos) << out[1];
  const std::vector<std::vector<std::string>> rows = {
      {"4", "256 KiB", "256 KiB", "1.000x", "5,000", "1.8800 ± 0.0100", "+0.0000", "2.7123"},
      {"2", "128 KiB", "128 KiB", "0.500x", "5,800", "1.8900 ± 0.0100", "+0.0100", "2.7267"},
      {"1", "64.0 KiB", "64.0 KiB", "0.250x", "6,200", "1.9500 ± 0.0100", "+0.0700", "2.8133"}};
  for (std::size_t i = 0; i < rows.size(); ++i) EXPECT_EQ(cells(out[2 + i]), rows[i]);
  EXPECT_EQ(out[5], "");  // exactly three rows

  const std::vector<std::string> detail = {"n_kv_head",
                                           "params",
                                           "bits/token",
                                           "cache bytes/token",
                                           "cache bytes/byte",
                                           "sequences in budget",
                                           "tokens/s (no cache)",
                                           "cache speed-up",
                                           "TTFT",
                                           "TPOT"};
  EXPECT_EQ(cells(out[6]), detail);
  EXPECT_EQ(cells(out[8]), (std::vector<std::string>{"4", "800,000", "2.7123", "4.00 KiB", "4096.0",
                                                     "4,096", "800", "6.25x", "1.20 ms", "0.200 ms"}));
  EXPECT_EQ(cells(out[10])[0], "1");
  EXPECT_EQ(out[11], "");
  EXPECT_EQ(out[12].rfind("verdicts", 0), 0u);
  EXPECT_EQ(out.size(), 16u);  // three verdict lines
}

// A task's sweep (--task mqar): the record table gains the answers' accuracy, and each finding
// says whether the variant recalls more or fewer answers than MHA, judged by the seeds' spread.
TEST(FormatTable, ATaskSweepShowsAndJudgesTheAnswersAccuracy) {
  json r = fixture();
  for (json& v : r["variants"]) {
    const int kv = v["n_kv_head"];
    v["val_accuracy_mean"] = kv == 4 ? 0.98 : kv == 2 ? 0.97 : 0.60;
    v["val_accuracy_std"] = 0.01;
  }
  const std::string out = format_table(r);
  EXPECT_NE(out.find("| answer accuracy"), std::string::npos) << out;
  EXPECT_NE(out.find("0.600 ± 0.010"), std::string::npos) << out;
  const auto f = report_detail::findings(report_detail::parse(r));
  ASSERT_EQ(f.size(), 2u);
  EXPECT_NE(f[0].text.find("It recalls 0.970 ± 0.010 of the answers against MHA's 0.980 ± 0.010, "
                           "within the seeds' spread"),
            std::string::npos)
      << f[0].text;
  EXPECT_NE(f[1].text.find("It recalls 0.600 ± 0.010 of the answers against MHA's 0.980 ± 0.010: "
                           "fewer than MHA, beyond the seeds' spread"),
            std::string::npos)
      << f[1].text;
  // A text sweep has no such column.
  EXPECT_EQ(format_table(fixture()).find("answer accuracy"), std::string::npos);
}

// The serving sweep's findings: a variant whose runs' range at the top rate stays clear of
// MHA's is beyond the run-to-run spread; one whose range overlaps it is within.
TEST(FormatTable, ServingSweepFindingsSayWhatIsBeyondTheSpread) {
  json r = fixture();
  auto sweep = [](double lo, double hi, double sustained, json& v) {
    v["serve_requests_per_s_continuous"] = 10;
    v["serve_requests_per_s_static"] = 4;
    v["serve_sustained_rate"] = sustained;
    v["serve_sweep"] = json::array({{{"rate", 5}, {"requests_per_s", {5, 5}}, {"ttft_p99_ms", {9, 11}}},
                                    {{"rate", 20}, {"requests_per_s", {lo, hi}}, {"ttft_p99_ms", {900, 950}}}});
  };
  for (json& v : r["variants"]) {
    const int kv = v["n_kv_head"];
    if (kv == 4) sweep(10, 11, 5, v);   // MHA
    if (kv == 2) sweep(10.5, 12, 5, v);  // overlaps MHA's 10-11
    if (kv == 1) sweep(14, 15, 20, v);   // clear of it
  }
  const std::string out = format_table(r);
  EXPECT_NE(out.find("n_kv_head=4 (MHA) sustains 5.00 requests/s."), std::string::npos) << out;
  EXPECT_NE(out.find("n_kv_head=2 (GQA) sustains 5.00 requests/s; at 20.00 requests/s offered it "
                     "serves 10.50-12.00 against MHA's 10.00-11.00: within the run-to-run spread."),
            std::string::npos)
      << out;
  EXPECT_NE(out.find("n_kv_head=1 (MQA) sustains 20.00 requests/s; at 20.00 requests/s offered it "
                     "serves 14.00-15.00 against MHA's 10.00-11.00: more than MHA, beyond the "
                     "run-to-run spread."),
            std::string::npos)
      << out;
  for (json& v : r["variants"])
    if (v["n_kv_head"] == 1) sweep(6, 7, 5, v);  // below MHA's range
  const std::string fewer = format_table(r);
  EXPECT_NE(fewer.find("serves 6.00-7.00 against MHA's 10.00-11.00: fewer than MHA, beyond the "
                       "run-to-run spread."),
            std::string::npos)
      << fewer;
}

// The memory-quality frontier: a point is on it when no other has as few bytes at a lower
// loss; the findings name the best point within each budget and say whether fewer KV heads
// make a dtype costlier beyond the seeds' spread.
TEST(FormatTable, QualityFrontierAndItsFindings) {
  json r = fixture();
  auto point = [](const char* dtype, double bytes, double loss, double delta, double delta_std) {
    return json{{"dtype", dtype},          {"bytes_per_token", bytes}, {"loss_mean", loss},
                {"loss_std", 0.001},       {"delta_loss_mean", delta}, {"delta_loss_std", delta_std},
                {"kl_mean", delta / 10},   {"kl_std", 0.0},            {"top1_mean", 0.99}};
  };
  for (json& v : r["variants"]) {
    const int kv = v["n_kv_head"];
    const double base = kv == 4 ? 2.0 : kv == 2 ? 2.01 : 2.05;
    const double int4 = kv == 1 ? 0.02 : 0.001;  // MQA pays far more for int4
    v["kv_quality"] = json::array({point("f32", 64.0 * kv, base, 0, 0),
                                   point("int4", 12.0 * kv, base + int4, int4, 0.001)});
  }
  const std::string out = format_table(r);
  // Frontier, by bytes: MQA int4 (12), GQA int4 (24), MHA int4 (48, below MQA f32's 64 and
  // GQA f32's 128) and MHA f32 (256, the lowest loss).
  EXPECT_NE(out.find("Within 12 bytes per token the lowest val loss is n_kv_head=1 (MQA) with "
                     "int4 keys and values: 2.0700 ± 0.0010."),
            std::string::npos)
      << out;
  EXPECT_NE(out.find("Within 24 bytes per token the lowest val loss is n_kv_head=2 (GQA)"),
            std::string::npos)
      << out;
  EXPECT_NE(out.find("Within 48 bytes per token the lowest val loss is n_kv_head=4 (MHA)"),
            std::string::npos)
      << out;
  EXPECT_EQ(out.find("Within 64 bytes"), std::string::npos) << out;  // MQA f32: dominated
  EXPECT_NE(out.find("int4 costs +0.00100 ± 0.00100 nats at n_kv_head=4 (MHA) and +0.02000 ± "
                     "0.00100 at n_kv_head=1 (MQA) (costlier, by 0.01900 (20.00x), beyond the "
                     "seeds' spread); its mean KL 1.00e-04 ± 0.00e+00 and 2.00e-03 ± 0.00e+00 "
                     "(costlier, by 1.90e-03 (20.00x), beyond the seeds' spread)."),
            std::string::npos)
      << out;
  EXPECT_NE(out.find("Within 256 bytes per token the lowest val loss is n_kv_head=4 (MHA) with "
                     "f32"),
            std::string::npos)
      << out;
  // The table: a row per point, the frontier marked.
  EXPECT_NE(out.find("what each cache dtype costs"), std::string::npos);
  const auto rows = lines(out);
  EXPECT_EQ(std::count_if(rows.begin(), rows.end(),
                          [](const std::string& l) { return l.ends_with(" yes"); }),
            4);
}

// An uptrain section as kvlab ablate --uptrain writes it: at n_kv_head 2, mean and first
// start apart and end within the seeds' spread, random starts far worse; from scratch is the
// fixture's n_kv_head 2 variant (1.89 ± 0.01).
json with_uptrain(json r, int seeds = 3) {
  auto entry = [&](const char* method, double conv, double up) {
    json runs = json::array();
    for (int s = 0; s < seeds; ++s) {
      const double d = 0.01 * (s - (seeds - 1) / 2.0);
      json curve = json::array();
      for (int step = 0; step <= 100; step += 20)
        curve.push_back({{"step", step}, {"val_loss", conv + (up - conv) * step / 100.0 + d}});
      runs.push_back({{"seed", s}, {"curve", curve}, {"val_loss_converted", conv + d},
                      {"val_loss_uptrained", up + d}});
    }
    return json{{"n_kv_head", 2},
                {"method", method},
                {"runs", runs},
                {"val_loss_converted_mean", conv},
                {"val_loss_converted_std", 0.01},
                {"val_loss_uptrained_mean", up},
                {"val_loss_uptrained_std", 0.01},
                {"val_loss_scratch_mean", 1.89},
                {"val_loss_scratch_std", 0.01},
                {"uptrain_steps", 100},
                {"scratch_steps", 2000},
                {"scratch_tokens", 2000 * 768},
                {"uptrained_steps", 2100},
                {"uptrained_tokens", 2100 * 768}};
  };
  r["uptrain"] = {{"fraction", 0.05},
                  {"steps", 100},
                  {"source_n_kv_head", 4},
                  {"source_val_loss", {{"mean", 1.88}, {"std", 0.01}}},
                  {"lr_schedule", "the sweep's schedule scaled to the 100 steps"},
                  {"entries", json::array({entry("mean", 2.00, 1.90), entry("first", 2.10, 1.905),
                                           entry("random", 3.50, 1.95)})}};
  return r;
}

TEST(FormatTable, UptrainTableAndFindings) {
  const std::string out = format_table(with_uptrain(fixture()));
  EXPECT_NE(out.find("uptraining converted MHA checkpoints (5% of the steps"), std::string::npos)
      << out;
  // A row per method: after conversion, after uptraining, from scratch, the gap, the compute.
  const auto rows = lines(out);
  const auto mean_row = std::find_if(rows.begin(), rows.end(), [](const std::string& l) {
    return l.find("|   mean |") != std::string::npos;
  });
  ASSERT_NE(mean_row, rows.end()) << out;
  EXPECT_EQ(cells(*mean_row),
            (std::vector<std::string>{"2", "mean", "2.0000 ± 0.0100", "1.9000 ± 0.0100",
                                      "1.8900 ± 0.0100", "+0.0100", "2,100 (1,612,800 tokens)",
                                      "2,000 (1,536,000 tokens)"}));
  EXPECT_NE(out.find("At n_kv_head=2, right after conversion: mean beats first by 0.1000, beyond "
                     "the seeds' spread (2.0000 ± 0.0100 vs 2.1000 ± 0.0100); after uptraining: "
                     "mean and first are within the seeds' spread of each other (1.9000 ± "
                     "0.0100 vs 1.9050 ± 0.0100)."),
            std::string::npos)
      << out;
  EXPECT_NE(out.find("right after conversion: mean beats random by 1.5000, beyond the seeds' "
                     "spread"),
            std::string::npos)
      << out;
  EXPECT_NE(out.find("At n_kv_head=2, 5% uptraining (100 steps) against training from scratch "
                     "(1.8900 ± 0.0100): mean ends at 1.9000 ± 0.0100, a gap of +0.0100 (within "
                     "the seeds' spread: as good as from scratch)"),
            std::string::npos)
      << out;
  EXPECT_NE(out.find("random ends at 1.9500 ± 0.0100, a gap of +0.0600 (above from scratch, "
                     "beyond the seeds' spread)."),
            std::string::npos)
      << out;
  // One seed: nothing is ranked.
  const std::string one = format_table(with_uptrain(fixture(1), 1));
  EXPECT_EQ(one.find("beats"), std::string::npos) << one;
  EXPECT_NE(one.find("mean is lower than first by 0.1000 (2.0000 ± 0.0100 vs 2.1000 ± 0.0100), "
                     "1 seed, so no spread to judge by"),
            std::string::npos)
      << one;
  // Without the section nothing of it shows.
  EXPECT_EQ(format_table(fixture()).find("uptrain"), std::string::npos);
  // Equal parameter counts say nothing of size; a parameter-matched sweep's wider from-scratch
  // model is named.
  json same = with_uptrain(fixture());
  json wider = same;
  for (json& e : same["uptrain"]["entries"]) e["params_uptrained"] = e["params_scratch"] = 5000;
  for (json& e : wider["uptrain"]["entries"]) {
    e["params_uptrained"] = 5000;
    e["params_scratch"] = 5400;
  }
  EXPECT_EQ(format_table(same).find("differ in size"), std::string::npos);
  EXPECT_NE(format_table(wider).find("The two sides differ in size (n_kv_head 2: 5000 parameters "
                                     "converted, 5400 from scratch): a converted model keeps the "
                                     "multi-head MLP while the from-scratch one was "
                                     "parameter-matched"),
            std::string::npos)
      << format_table(wider);
}

// weight_quality as kvlab ablate --weight-dtypes writes it: per variant the f32 model's decode
// weight bytes and each matrix type's (1 MiB at f32: bf16 half, q8_0 and q4_0 their blocks').
json with_weight_quality(json r) {
  auto point = [](const char* dtype, double bytes, double delta, double kl) {
    return json{{"dtype", dtype},           {"decode_weight_bytes", bytes},
                {"loss_mean", 1.9 + delta}, {"loss_std", 0.01},
                {"delta_loss_mean", delta}, {"delta_loss_std", delta / 4},
                {"kl_mean", kl},            {"kl_std", kl / 2},
                {"top1_mean", 1 - kl * 10}, {"positions", 16384}};
  };
  for (json& v : r["variants"]) {
    v["decode_weight_bytes_f32"] = 1048576.0;
    v["weight_quality"] = json::array({point("bf16", 524288.0, 0.00002, 1e-6),
                                       point("q8_0", 294912.0, 0.00012, 4e-5),
                                       point("q4_0", 163840.0, 0.004, 2e-3)});
  }
  return r;
}

TEST(FormatTable, WeightDtypesTableAndFinding) {
  const std::string out = format_table(with_weight_quality(fixture()));
  EXPECT_NE(out.find("what each weight dtype costs"), std::string::npos) << out;
  // A row per (variant, dtype): bytes in human units, the ratio to f32, the delta with its sd.
  EXPECT_NE(out.find(" q8_0 |             288 KiB | 0.281x | 1.9001 ± 0.0100 | +0.00012 ± "
                     "0.00003 | 4.00e-05 ± 2.00e-05 |          0.9996"),
            std::string::npos)
      << out;
  EXPECT_EQ(count(out, " q4_0 | "), 3u);
  // Results written before the weight dtypes were measured: no table.
  EXPECT_EQ(format_table(fixture()).find("weight dtype"), std::string::npos);
}

TEST_F(ReportFiles, UptrainSectionAndPlot) {
  write_report(with_uptrain(fixture()), dir_);
  const std::string svg = read(dir_ / "uptrain_kv2.svg");
  EXPECT_EQ(test::xml_problem(svg), "");
  for (const std::string label : {"mean", "first", "random", "from scratch", "MHA source"})
    EXPECT_NE(svg.find(std::string(">").append(label).append("<")), std::string::npos) << label;
  EXPECT_EQ(count(svg, "class=\"err\""), 3u * 6u);  // a bar per method and evaluation
  const std::string md = read(dir_ / "report.md");
  EXPECT_NE(md.find("## Uptraining converted checkpoints"), std::string::npos);
  EXPECT_NE(md.find("(uptrain_kv2.svg)"), std::string::npos);
  const std::string html = read(dir_ / "report.html");
  EXPECT_NE(html.find("Uptraining converted checkpoints"), std::string::npos);
  EXPECT_NE(html.find("mean beats first by 0.1000"), std::string::npos);
}

TEST(FormatTable, ColumnsLineUp) {
  const auto out = lines(format_table(fixture()));
  // "±" is one column wide: every line of the first table has the same number of code points.
  auto width = [](const std::string& s) {
    std::size_t n = 0;
    for (char c : s) n += (static_cast<unsigned char>(c) & 0xC0) != 0x80;
    return n;
  };
  for (std::size_t i = 1; i < 5; ++i) EXPECT_EQ(width(out[i]), width(out[0])) << out[i];
}

TEST(FormatTable, OneSeedIsLabelled) {
  const auto out = lines(format_table(fixture(1)));
  EXPECT_EQ(cells(out[2])[5], "1.8800 (1 seed)");
}

// --- files -------------------------------------------------------------------------------

TEST_F(ReportFiles, WritesEveryFile) {
  write_report(fixture(), dir_ / "out");
  for (const char* name : {"results.json", "results.csv", "report.md", "report.html"})
    EXPECT_GT(fs::file_size(dir_ / "out" / name), 0u) << name;
  for (const char* name : kSvgs) EXPECT_GT(fs::file_size(dir_ / "out" / name), 0u) << name;
  for (const auto& entry : fs::directory_iterator(dir_ / "out"))
    EXPECT_NE(entry.path().extension(), ".tmp") << entry.path();
}

TEST_F(ReportFiles, ResultsJsonRoundTrips) {
  const json r = fixture();
  write_report(r, dir_);
  EXPECT_EQ(json::parse(read(dir_ / "results.json")), r);
}

TEST_F(ReportFiles, SvgsAreWellFormedAndCurvesHaveALinePerSeed) {
  write_report(fixture(3), dir_);
  for (const char* name : kSvgs) {
    const std::string svg = read(dir_ / name);
    EXPECT_EQ(svg.rfind("<svg", 0), 0u) << name;
    EXPECT_EQ(test::xml_problem(svg), "") << name;
  }
  const std::string curves = read(dir_ / "val_loss_curves.svg");
  EXPECT_EQ(count(curves, "<polyline class=\"seed\""), 3u * 3u);
  EXPECT_EQ(count(curves, "<polyline class=\"mean\""), 3u);
  for (const char* label : {"n_kv_head=4 (MHA)", "n_kv_head=2 (GQA)", "n_kv_head=1 (MQA)"})
    EXPECT_NE(curves.find(label), std::string::npos) << label;
  // Error bars on the loss plot, one per variant.
  EXPECT_EQ(count(read(dir_ / "val_loss_vs_kv.svg"), "class=\"err\""), 3u);
  const std::string speed = read(dir_ / "tokens_per_s_vs_kv.svg");
  EXPECT_NE(speed.find("with KV cache"), std::string::npos);
  EXPECT_NE(speed.find("without KV cache"), std::string::npos);
}

TEST_F(ReportFiles, HtmlIsSelfContainedAndEscapesSamples) {
  write_report(fixture(), dir_);
  const std::string html = read(dir_ / "report.html");
  EXPECT_EQ(count(html, "http://"), count(html, "xmlns=\"http://www.w3.org/2000/svg\""));
  EXPECT_EQ(count(html, "https://"), 0u);
  EXPECT_EQ(count(html, "<svg"), 5u);
  EXPECT_NE(html.find("@media print"), std::string::npos);  // printable: tables and figures whole
  EXPECT_NE(html.find("break-inside:avoid"), std::string::npos);
  for (const char* external : {"<script", "<link", "src=", "@import", "url("})
    EXPECT_EQ(html.find(external), std::string::npos) << external;
  for (int n_kv : {4, 2, 1}) {
    EXPECT_NE(html.find(greedy_escaped(n_kv)), std::string::npos) << n_kv;
    EXPECT_NE(html.find(sampled_escaped(n_kv)), std::string::npos) << n_kv;
    EXPECT_EQ(html.find(sampled_text(n_kv)), std::string::npos) << n_kv;
  }
  EXPECT_EQ(html.find("<say>"), std::string::npos);
  EXPECT_NE(html.find("not distinguishable at this budget"), std::string::npos);
}

TEST_F(ReportFiles, CsvHasAHeaderAndOneRowPerVariant) {
  json r = fixture();
  r["variants"][0]["note"] = "plain, \"quoted\"";  // an extra scalar on one variant only
  write_report(r, dir_);
  const auto csv = lines(read(dir_ / "results.csv"));
  ASSERT_EQ(csv.size(), 4u);
  const auto header = csv_fields(csv[0]);
  EXPECT_EQ(header[0], "n_kv_head");
  const auto col = [&](const std::string& name) {
    return std::find(header.begin(), header.end(), name) - header.begin();
  };
  ASSERT_LT(col("note"), static_cast<long>(header.size()));
  ASSERT_LT(col("cache_bytes_context_measured"), static_cast<long>(header.size()));
  const std::vector<std::string> order = {"4", "2", "1"};
  for (std::size_t i = 1; i < csv.size(); ++i) {
    const auto row = csv_fields(csv[i]);
    ASSERT_EQ(row.size(), header.size()) << csv[i];
    EXPECT_EQ(row[0], order[i - 1]);
  }
  EXPECT_EQ(csv_fields(csv[1])[col("cache_bytes_context_measured")], "262144");
  EXPECT_EQ(csv_fields(csv[2])[col("note")], "plain, \"quoted\"");  // n_kv_head=2
  EXPECT_EQ(csv_fields(csv[1])[col("note")], "");
  EXPECT_EQ(csv_fields(csv[1])[col("seeds")], "3");
}

TEST_F(ReportFiles, MarkdownCarriesTablesVerdictsPlotsAndSamples) {
  json r = fixture();
  r["variants"][2]["samples"][0]["greedy"] = "O Romeo's #1";
  write_report(r, dir_);
  const std::string md = read(dir_ / "report.md");
  EXPECT_NE(
      md.find("| n_kv_head | cache bytes (measured) | formula | vs MHA | tokens/s | val loss | Δ val loss vs MHA |"),
      std::string::npos);
  EXPECT_NE(md.find("| 4 | 256 KiB | 256 KiB |"), std::string::npos);  // human units
  for (const char* name : kSvgs)
    EXPECT_NE(md.find(std::string("(") + name + ")"), std::string::npos);
  EXPECT_NE(md.find("not distinguishable at this budget"), std::string::npos);
  EXPECT_NE(md.find("What &lt;say&gt; you &amp; &quot;I&quot;? kv4"), std::string::npos);
  EXPECT_NE(md.find("O Romeo&#39;s \\#1"), std::string::npos);  // a whole reference
  EXPECT_EQ(md.find("&\\#"), std::string::npos);
  EXPECT_NE(md.find("AMD EPYC (Zen 3)"), std::string::npos);
  EXPECT_NE(md.find("123.4 s (2 min 3 s)"), std::string::npos);
}

// --- human units and the findings ---------------------------------------------------------

TEST(HumanUnits, BytesCountsRatesAndTimesOnHandCheckedValues) {
  using report_detail::bytes, report_detail::grouped, report_detail::rate,
      report_detail::millis;
  EXPECT_EQ(bytes(96.0), "96 B");
  EXPECT_EQ(bytes(1023.0), "1023 B");
  EXPECT_EQ(bytes(1280.0), "1.25 KiB");      // int8 at n_kv_head 8: 1.25 x 1024
  EXPECT_EQ(bytes(32768.0), "32.0 KiB");
  EXPECT_EQ(bytes(262144.0), "256 KiB");
  EXPECT_EQ(bytes(1048575.0), "1.00 MiB");   // 1023.999 KiB rounds up into the next unit
  EXPECT_EQ(bytes(4194304.0), "4.00 MiB");
  EXPECT_EQ(bytes(1073741824.0), "1.00 GiB");
  EXPECT_EQ(bytes(std::nullopt), "-");
  EXPECT_EQ(grouped(999), "999");
  EXPECT_EQ(grouped(1000), "1,000");
  EXPECT_EQ(grouped(810880), "810,880");
  EXPECT_EQ(grouped(1234567), "1,234,567");
  EXPECT_EQ(grouped(-32768), "-32,768");
  EXPECT_EQ(rate(41.54), "41.5");
  EXPECT_EQ(rate(2018.4), "2,018");
  EXPECT_EQ(millis(0.4953), "0.495 ms");
  EXPECT_EQ(millis(3.171), "3.17 ms");
  EXPECT_EQ(millis(871.2), "871 ms");
  EXPECT_EQ(millis(999.7), "1.00 s");
  EXPECT_EQ(millis(1489.0), "1.49 s");
}

// A finished default ablation's results (4 variants x 3 seeds, with the serving workload, the
// cache-dtype frontier and the paired evaluation), as the browser test renders them.
json default_results() {
  return json::parse(read(fs::path(KVLAB_SOURCE_DIR) / "tests/report/browser/results.json"));
}

// Where the results hold the paired evaluation, it decides each pair's verdict (naming the side
// with the lower loss on the shared windows), with the seed-spread verdict beside it; the
// terminal's verdicts and findings say the same.
TEST(CompareVariants, ThePairedVerdictDecidesWhereTheResultsHoldIt) {
  json r = default_results();
  const json& pairs = r["generation_quality"]["pairs"];
  const auto find = [](const std::vector<Verdict>& vs, const std::string& a, const std::string& b) {
    for (const Verdict& v : vs)
      if (v.a == a && v.b == b) return v;
    ADD_FAILURE() << a << " vs " << b << " not judged";
    return Verdict{};
  };
  const std::string mha = "n_kv_head=8 (MHA)", g4 = "n_kv_head=4 (GQA)", g2 = "n_kv_head=2 (GQA)";
  const auto mean_diff = [&](const char* a, const char* b) {
    for (const json& p : pairs)
      if (p["a"] == a && p["b"] == b) {
        double sum = 0;
        for (const json& s : p["seeds"]) sum += s["mean_diff"].get<double>();
        return sum / static_cast<double>(p["seeds"].size());
      }
    ADD_FAILURE() << a << "-" << b << " not in the fixture";
    return 0.0;
  };
  const auto spread = compare_variants(json{{"config", r["config"]}, {"variants", r["variants"]}});
  const auto paired = compare_variants(r);
  ASSERT_EQ(paired.size(), spread.size());

  // kv2 - kv8 is positive in every seed's interval: MHA has the lower loss, by the seeds' mean.
  const Verdict v82 = find(paired, mha, g2);
  EXPECT_TRUE(v82.distinguishable);
  char by[32];
  std::snprintf(by, sizeof by, "%.4f", mean_diff("kv8", "kv2"));
  EXPECT_NE(v82.text.find("paired on 256 shared windows, " + mha + " has the lower loss, by " + by),
            std::string::npos)
      << v82.text;
  const Verdict s82 = find(spread, mha, g2);
  EXPECT_FALSE(s82.distinguishable) << s82.text;  // the seeds' spread alone cannot tell them
  EXPECT_NE(v82.text.find("by the seeds' spread of the val loss, " +
                          s82.text.substr((mha + " vs " + g2 + ": ").size())),
            std::string::npos)
      << v82.text;

  // The seeds disagree in sign for kv8/kv4; a seed's interval holds 0 for kv4/kv2.
  const Verdict v84 = find(paired, mha, g4), v42 = find(paired, g4, g2);
  EXPECT_FALSE(v84.distinguishable);
  EXPECT_NE(v84.text.find("not distinguishable: the seeds' intervals fall on both sides of 0"),
            std::string::npos)
      << v84.text;
  EXPECT_FALSE(v42.distinguishable);
  EXPECT_NE(v42.text.find("not distinguishable: a seed's 95% interval holds 0"), std::string::npos)
      << v42.text;

  // Flipped signs name the other side.
  json flipped = r;
  for (json& p : flipped["generation_quality"]["pairs"])
    if (p["a"] == "kv8" && p["b"] == "kv2")
      for (json& s : p["seeds"]) {
        s["mean_diff"] = -s["mean_diff"].get<double>();
        s["ci95"] = {-s["ci95"][1].get<double>(), -s["ci95"][0].get<double>()};
      }
  const Verdict f82 = find(compare_variants(flipped), mha, g2);
  EXPECT_NE(f82.text.find("paired on 256 shared windows, " + g2 + " has the lower loss, by " + by),
            std::string::npos)
      << f82.text;

  // The terminal's verdict lines carry the paired verdict (the findings: below).
  const std::string out = format_table(r);
  EXPECT_NE(out.find("  " + v82.text + "\n"), std::string::npos) << out;
}

// Text as a reader sees it: tags out, the escapes the report writes (an apostrophe's &#39;)
// back to their characters.
std::string strip_tags(const std::string& html) {
  std::string out = std::regex_replace(html, std::regex("<[^>]*>"), " ");
  for (const auto& [escape, c] : std::vector<std::pair<std::string, std::string>>{
           {"&#39;", "'"}, {"&quot;", "\""}, {"&lt;", "<"}, {"&gt;", ">"}, {"&amp;", "&"}})
    for (auto at = out.find(escape); at != std::string::npos; at = out.find(escape, at))
      out.replace(at, escape.size(), c);
  return out;
}

// Figures as a reader sees them: a number with its unit or "x".
std::vector<std::string> numbers_in(const std::string& text) {
  static const std::regex number(R"([-+]?[0-9]+(,[0-9]{3})*(\.[0-9]+)?(e[-+][0-9]+)?(x| (B|KiB|MiB|GiB))?)");
  std::vector<std::string> out;
  for (std::sregex_iterator it(text.begin(), text.end(), number), end; it != end; ++it)
    out.push_back(it->str());
  return out;
}

// Whether `figure` stands in `text` as a whole figure, not inside a longer one.
bool shows(const std::string& text, const std::string& figure) {
  const auto digit = [&](std::size_t i) {
    return i < text.size() && std::isdigit(static_cast<unsigned char>(text[i]));
  };
  for (auto at = text.find(figure); at != std::string::npos; at = text.find(figure, at + 1)) {
    const std::size_t end = at + figure.size();
    // A sentence's full stop ends a figure; "1.5" in "21.5" or "2" in "2.5" is part of one.
    const bool before = at > 0 && (digit(at - 1) || (text[at - 1] == '.' && at > 1 && digit(at - 2)));
    const bool after = digit(end) || (end < text.size() && text[end] == '.' && digit(end + 1));
    if (!before && !after) return true;
  }
  return false;
}

// From the HTML: each finding's text (its links' labels taken out) and link targets, and the
// text of each target: a table's cells, the verdicts list, a figure's caption and plot.
struct Linked {
  std::vector<std::pair<std::string, std::vector<std::string>>> findings;
  std::map<std::string, std::string> targets;
};

Linked html_findings(const std::string& html) {
  Linked out;
  const auto begin = html.find("<section id=\"findings\""), end = html.find("</section>", begin);
  const std::string section = html.substr(begin, end - begin);
  const std::regex li("<li>([\\s\\S]*?)</li>"), href("<a href=\"#([^\"]+)\">[^<]*</a>");
  for (std::sregex_iterator it(section.begin(), section.end(), li), e; it != e; ++it) {
    const std::string body = (*it)[1];
    std::vector<std::string> ids;
    for (std::sregex_iterator h(body.begin(), body.end(), href), he; h != he; ++h)
      ids.push_back((*h)[1]);
    out.findings.emplace_back(strip_tags(std::regex_replace(body, href, "")), ids);
  }
  const auto element = [&](const std::string& open, const std::string& close) {
    const auto at = html.find(open);
    return at == std::string::npos ? std::string()
                                   : strip_tags(html.substr(at, html.find(close, at) - at));
  };
  for (const auto& [text, ids] : out.findings)
    for (const std::string& id : ids)
      out.targets[id] = id == "verdicts"
                            ? element("<h3 id=\"verdicts\">", "</ul>")
                            : element((id.rfind("fig-", 0) == 0 ? "<figure id=\"" : "<table id=\"") +
                                          id + "\"",
                                      id.rfind("fig-", 0) == 0 ? "</figure>" : "</table>");
  return out;
}

// From the Markdown: the same, each target the block after its <a id> anchor.
Linked md_findings(const std::string& md) {
  Linked out;
  const auto begin = md.find("## Findings"), end = md.find("\n## ", begin + 1);
  const std::regex link(R"(\[[^\]]*\]\(#([^)]+)\))");
  for (const std::string& line : lines(md.substr(begin, end - begin))) {
    if (line.rfind("- ", 0) != 0) continue;
    std::vector<std::string> ids;
    for (std::sregex_iterator h(line.begin(), line.end(), link), he; h != he; ++h)
      ids.push_back((*h)[1]);
    out.findings.emplace_back(strip_tags(std::regex_replace(line, link, "")), ids);
  }
  for (const auto& [text, ids] : out.findings)
    for (const std::string& id : ids) {
      const auto at = md.find("<a id=\"" + id + "\"></a>");
      out.targets[id] = at == std::string::npos
                            ? std::string()
                            : strip_tags(md.substr(at, md.find("<a id=", at + 1) - at));
    }
  return out;
}

void expect_findings_match_their_tables(const Linked& l, const char* format) {
  ASSERT_FALSE(l.findings.empty()) << format;
  for (const auto& [text, ids] : l.findings) {
    ASSERT_FALSE(ids.empty()) << format << ": " << text;
    std::string shown;
    for (const std::string& id : ids) {
      ASSERT_FALSE(l.targets.at(id).empty()) << format << ": no " << id << " for " << text;
      shown += l.targets.at(id) + "\n";
    }
    for (const std::string& n : numbers_in(text))
      EXPECT_TRUE(shows(shown, n)) << format << ": " << n << " of \"" << text
                                   << "\" is in none of its tables";
  }
}

TEST_F(ReportFiles, EveryFigureOfTheFindingsIsTheOneItsTableShows) {
  for (const json& r : {default_results(), fixture(), mla_fixture()}) {
    write_report(r, dir_);
    const std::string html = read(dir_ / "report.html"), md = read(dir_ / "report.md");
    expect_findings_match_their_tables(html_findings(html), "html");
    expect_findings_match_their_tables(md_findings(md), "md");
  }
  // The figures checked are the ones that matter: MQA's loss cost and cache against MHA's,
  // the sequences held at the serving workload's memory, the best dtype within 256 B/token.
  write_report(default_results(), dir_);
  const auto l = html_findings(read(dir_ / "report.html"));
  ASSERT_EQ(l.findings.size(), 5u);  // the cheapest cache, three variants, then the dtypes
  // The first names the fewest bytes within one per cent of MHA's f32-cache loss: no point of
  // the results with fewer bytes is that close.
  const json r = default_results();
  double mha_f32 = 0;
  for (const json& v : r["variants"])
    for (const json& q : v["kv_quality"])
      if (v["n_kv_head"] == 8 && q["dtype"] == "f32") mha_f32 = q["loss_mean"];
  for (const json& v : r["variants"])
    for (const json& q : v["kv_quality"])
      if (q["bytes_per_token"].get<double>() < 384) {
        EXPECT_GT(q["loss_mean"].get<double>(), 1.01 * mha_f32) << v["n_kv_head"] << q["dtype"];
      }
  EXPECT_EQ(l.findings[0].first.rfind("The cheapest KV cache within one per cent of MHA's val loss "
                                      "is n_kv_head=4 (GQA) with int4 keys and values: 384 B per "
                                      "token against MHA's 4.00 KiB with f32, at 2.0870 ± 0.0150 "
                                      "against 2.0739 ± 0.0097.",
                                      0),
            0u)
      << l.findings[0].first;
  const std::string& mqa = l.findings[3].first;
  for (const char* figure : {"+0.0504", "0.125x", "32.0 KiB", "256 KiB", "4.00 MiB", "256", "82"})
    EXPECT_TRUE(shows(mqa, figure)) << figure << " in " << mqa;
  EXPECT_NE(mqa.find("has the lower val loss, by 0.0504"), std::string::npos) << mqa;
  // n_kv_head 2's finding carries the paired verdict, which tells it from MHA.
  EXPECT_NE(l.findings[2].first.find("(paired on 256 shared windows, n_kv_head=8 (MHA) has the "
                                     "lower loss, by 0.0267"),
            std::string::npos)
      << l.findings[2].first;
  EXPECT_NE(l.findings[4].first.find("within 256 B, n_kv_head=2 (GQA) with fp8"),
            std::string::npos)
      << l.findings[4].first;
}

TEST_F(ReportFiles, WeightDtypesSectionAfterTheCacheDtypes) {
  write_report(with_weight_quality(fixture()), dir_);
  const std::string md = read(dir_ / "report.md"), html = read(dir_ / "report.html");
  EXPECT_NE(md.find("## What each weight dtype costs"), std::string::npos);
  EXPECT_NE(html.find("<table id=\"table-weights\""), std::string::npos);
  EXPECT_NE(md.find("- q8_0 matrices cost n_kv_head=4 (MHA) +0.00012 ± 0.00003 nats of val loss "
                    "(mean KL 4.00e-05 ± 2.00e-05) for 0.281x the decode weight bytes of f32 "
                    "matrices (288 KiB)"),
            std::string::npos)
      << md;
  // Every figure of the new finding is the one its table shows, in both files.
  expect_findings_match_their_tables(html_findings(html), "html");
  expect_findings_match_their_tables(md_findings(md), "md");
  // After the cache dtypes' section where both are measured.
  write_report(with_weight_quality(default_results()), dir_);
  const std::string both = read(dir_ / "report.md");
  EXPECT_LT(both.find("<a id=\"table-quality\"></a>"), both.find("<a id=\"table-weights\"></a>"));
  EXPECT_NE(both.find("<a id=\"table-weights\"></a>"), std::string::npos);
}

// The findings open the report, the memory-quality frontier is its first table and figure,
// and each figure comes right after the table it illustrates, in the same order in both files.
TEST_F(ReportFiles, FindingsFirstThenEachTableWithItsFigures) {
  write_report(default_results(), dir_);
  const std::string html = read(dir_ / "report.html"), md = read(dir_ / "report.md");
  const std::vector<std::string> order = {
      "findings", "table-quality", "fig-val_loss_vs_cache_bytes", "fig-kl_vs_cache_bytes",
      "table-results", "fig-val_loss_curves", "fig-val_loss_curves_vs_mha",
      "fig-val_loss_vs_kv", "fig-cache_bytes_vs_kv", "verdicts", "table-details",
      "fig-tokens_per_s_vs_kv", "table-memory", "table-serving", "fig-served_vs_rate",
      "fig-ttft_p99_vs_rate", "table-generation", "fig-loss_by_position",
      "fig-recall_by_distance", "table-paired"};
  std::size_t in_html = 0, in_md = 0;
  for (const std::string& id : order) {
    const auto h = html.find("id=\"" + id + "\""), m = md.find("<a id=\"" + id + "\"></a>");
    ASSERT_NE(h, std::string::npos) << id;
    ASSERT_NE(m, std::string::npos) << id;
    EXPECT_GT(h, in_html) << id;
    EXPECT_GT(m, in_md) << id;
    in_html = h, in_md = m;
  }
  EXPECT_LT(html.find("id=\"findings\""), html.find("<table"));
  EXPECT_EQ(count(html, "<figcaption>"), count(html, "<svg"));
}

TEST_F(ReportFiles, UnwritableFolderNamesThePath) {
  std::ofstream(dir_ / "a_file") << "x";
  const fs::path out = dir_ / "a_file" / "report";
  try {
    write_report(fixture(), out);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(out.string()), std::string::npos) << e.what();
  }
}

TEST_F(ReportFiles, BadDocumentWritesNothing) {
  EXPECT_THROW(write_report(json{{"variants", json::array()}}, dir_ / "out"), Error);
  EXPECT_FALSE(fs::exists(dir_ / "out"));
}

TEST_F(ReportFiles, InvalidUtf8InSamplesDoesNotThrow) {
  json r = fixture();
  r["variants"][0]["samples"][0]["sampled"] = std::string("bytes \xff\xfe end");
  ASSERT_NO_THROW(write_report(r, dir_));
  EXPECT_NE(read(dir_ / "report.html").find("bytes \xEF\xBF\xBD\xEF\xBF\xBD end"),
            std::string::npos);
}

TEST_F(ReportFiles, PngsWhenRsvgConvertIsOnPath) {
  if (!on_path("rsvg-convert")) GTEST_SKIP() << "rsvg-convert not on PATH";
  write_report(fixture(), dir_);
  for (const char* name : kSvgs) {
    const fs::path png = (dir_ / name).replace_extension(".png");
    EXPECT_EQ(read(png).substr(0, 4), "\x89PNG") << png;
  }
}

TEST_F(ReportFiles, NoRsvgConvertSkipsPngsSilently) {
  const std::string saved = std::getenv("PATH") ? std::getenv("PATH") : "";
  fs::create_directory(dir_ / "empty_bin");
  ::setenv("PATH", (dir_ / "empty_bin").c_str(), 1);
  EXPECT_NO_THROW(write_report(fixture(), dir_ / "out"));
  ::setenv("PATH", saved.c_str(), 1);
  for (const auto& entry : fs::directory_iterator(dir_ / "out"))
    EXPECT_NE(entry.path().extension(), ".png") << entry.path();
  EXPECT_TRUE(fs::exists(dir_ / "out" / "report.html"));
}

}  // namespace
}  // namespace kvlab
