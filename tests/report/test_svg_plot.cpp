#include <gtest/gtest.h>

#include <cmath>

#include "report/svg_plot.h"
#include "tests/report/xml_check.h"

namespace kvlab::svg {
namespace {

std::size_t count(const std::string& s, const std::string& what) {
  std::size_t n = 0;
  for (std::size_t i = s.find(what); i != std::string::npos; i = s.find(what, i + 1)) ++n;
  return n;
}

TEST(NiceAxis, RoundsOutToOneTwoFiveSteps) {
  const Axis a = nice_axis(0.13, 0.97);
  EXPECT_DOUBLE_EQ(a.step, 0.2);
  EXPECT_DOUBLE_EQ(a.lo, 0.0);
  EXPECT_DOUBLE_EQ(a.hi, 1.0);
  ASSERT_EQ(a.ticks.size(), 6u);
  EXPECT_DOUBLE_EQ(a.ticks[3], 0.6);

  const Axis b = nice_axis(1.881, 1.952);
  EXPECT_DOUBLE_EQ(b.step, 0.02);
  EXPECT_NEAR(b.lo, 1.88, 1e-12);
  EXPECT_NEAR(b.hi, 1.96, 1e-12);

  const Axis c = nice_axis(0, 5200);
  EXPECT_DOUBLE_EQ(c.step, 2000);
  EXPECT_DOUBLE_EQ(c.hi, 6000);
}

TEST(NiceAxis, BoundsOnATickStayPut) {
  const Axis a = nice_axis(0, 1);
  EXPECT_DOUBLE_EQ(a.lo, 0);
  EXPECT_DOUBLE_EQ(a.hi, 1);
}

TEST(NiceAxis, DegenerateRangeWidens) {
  for (double v : {0.0, 2.5, -7.0}) {
    const Axis a = nice_axis(v, v);
    EXPECT_LT(a.lo, v);
    EXPECT_GT(a.hi, v);
    EXPECT_GE(a.ticks.size(), 2u);
  }
}

TEST(FormatTick, DecimalsFollowTheStep) {
  EXPECT_EQ(format_tick(0.4000000001, 0.2), "0.4");
  EXPECT_EQ(format_tick(1.9, 0.05), "1.90");
  EXPECT_EQ(format_tick(4000, 2000), "4000");
  EXPECT_EQ(format_tick(-1e-17, 0.2), "0.0");
}

TEST(EscapeXml, EscapesMarkupAndReplacesBadBytes) {
  EXPECT_EQ(escape_xml("<a href=\"x\">&'</a>"), "&lt;a href=&quot;x&quot;&gt;&amp;&#39;&lt;/a&gt;");
  EXPECT_EQ(escape_xml("line\nnext\ttab ± é"), "line\nnext\ttab ± é");
  EXPECT_EQ(escape_xml(std::string("a\x01"
                                   "b")),
            "a\xEF\xBF\xBD"
            "b");
  EXPECT_EQ(escape_xml("a\xff"
                       "b"),
            "a\xEF\xBF\xBD"
            "b");
  EXPECT_EQ(escape_xml("\xC3"), "\xEF\xBF\xBD");  // truncated sequence
}

TEST(Render, DrawsEverySeriesLegendAndErrorBars) {
  Plot p;
  p.title = "loss <&> title";
  p.x_label = "n_kv_head";
  p.y_label = "loss";
  p.x_ticks = {1, 2, 4};
  p.x_log2 = true;
  Series a;
  a.label = "with error bars";
  a.x = {1, 2, 4};
  a.y = {1.9, 1.85, 1.8};
  a.y_err = {0.01, 0.0, 0.02};
  a.markers = true;
  a.css_class = "a";
  Series b;
  b.label = "dashed";
  b.dashed = true;
  b.x = {1, 2, 4};
  b.y = {2.0, std::nan(""), 1.95};  // the NaN point is skipped
  b.css_class = "b";
  p.series = {a, b};
  const std::string svg = render(p);

  EXPECT_EQ(svg.rfind("<svg", 0), 0u);
  EXPECT_EQ(kvlab::test::xml_problem(svg), "");
  EXPECT_EQ(count(svg, "<polyline"), 2u);
  EXPECT_EQ(count(svg, "class=\"err\""), 2u);  // the zero-width bar is not drawn
  EXPECT_EQ(count(svg, "<circle"), 3u + 1u);   // three markers plus the legend marker
  EXPECT_NE(svg.find("loss &lt;&amp;&gt; title"), std::string::npos);
  EXPECT_NE(svg.find(">with error bars</text>"), std::string::npos);
  EXPECT_NE(svg.find(">dashed</text>"), std::string::npos);
  EXPECT_NE(svg.find("stroke-dasharray"), std::string::npos);
  EXPECT_EQ(svg.find("nan"), std::string::npos);
  // Explicit ticks are labelled with their values.
  for (const char* tick : {">1</text>", ">2</text>", ">4</text>"})
    EXPECT_NE(svg.find(tick), std::string::npos) << tick;
}

TEST(Render, EmptyPlotIsStillWellFormed) {
  Plot p;
  p.title = "nothing";
  const std::string svg = render(p);
  EXPECT_EQ(kvlab::test::xml_problem(svg), "");
  EXPECT_EQ(svg.find("<polyline"), std::string::npos);
}

TEST(XmlCheck, CatchesBrokenMarkup) {
  using kvlab::test::xml_problem;
  EXPECT_EQ(xml_problem("<svg><g></g></svg>"), "");
  EXPECT_NE(xml_problem("<svg><g></svg>"), "");
  EXPECT_NE(xml_problem("<svg></svg><svg></svg>"), "");
  EXPECT_NE(xml_problem("<svg><text>a & b</text></svg>"), "");
  EXPECT_NE(xml_problem("<svg width=10></svg>"), "");
}

}  // namespace
}  // namespace kvlab::svg
