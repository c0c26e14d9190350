#pragma once
// A small SVG line-plot writer for the ablation report: axes with nice-number ticks, title,
// axis labels, legend, lines, markers and error bars. Output is a standalone <svg> element
// that starts with "<svg", so the same text is a file and can be inlined into HTML.
#include <string>
#include <string_view>
#include <vector>

namespace kvlab::svg {

struct Series {
  std::string label;  // legend text; empty keeps the series out of the legend
  std::string color = "#1f77b4";
  std::vector<double> x, y;   // non-finite points are skipped
  std::vector<double> y_err;  // symmetric error bars, same length as y; empty for none
  double line_width = 2.0;    // 0 draws no line (markers only)
  double opacity = 1.0;
  bool markers = false;
  bool dashed = false;
  std::string css_class;  // class of the line, e.g. "seed" or "mean"
};

struct Plot {
  std::string title;
  std::string note;  // smaller line under the title; may be empty
  std::string x_label, y_label;
  std::vector<Series> series;
  // Explicit x ticks (e.g. the n_kv_head values); empty gives nice numbers, or on a log2 axis
  // the powers of two that span the data.
  std::vector<double> x_ticks;
  bool x_log2 = false;       // place x by log2, for n_kv_head = 1, 2, 4, 8, ...
  bool y_from_zero = false;  // include 0 in the y range
  int width = 760, height = 440;
};

// Axis range extended to multiples of a 1/2/5 x 10^k step, and the ticks inside it.
struct Axis {
  double lo = 0, hi = 1, step = 1;
  std::vector<double> ticks;
};
Axis nice_axis(double lo, double hi, int target_ticks = 5);

// Tick label with as many decimals as the step needs ("0.2" -> 1 decimal, "50" -> none).
std::string format_tick(double value, double step);

// Escapes & < > " ' and replaces control characters XML 1.0 forbids; valid in HTML too.
std::string escape_xml(std::string_view text);

// Colour i of a categorical palette that stays distinguishable on white.
const std::string& palette(std::size_t i);

std::string render(const Plot& plot);

}  // namespace kvlab::svg
