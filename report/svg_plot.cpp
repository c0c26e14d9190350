#include "report/svg_plot.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <sstream>

namespace kvlab::svg {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

std::string num(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f", v);
  return buf;
}

// Number of bytes of the UTF-8 sequence starting at s[i], or 0 when it is not valid.
std::size_t utf8_length(std::string_view s, std::size_t i) {
  const auto c = static_cast<unsigned char>(s[i]);
  std::size_t n = c < 0x80                 ? 1
                  : c >= 0xC2 && c <= 0xDF ? 2
                  : c >= 0xE0 && c <= 0xEF ? 3
                  : c >= 0xF0 && c <= 0xF4 ? 4
                                           : 0;
  if (n == 0 || i + n > s.size()) return 0;
  for (std::size_t k = 1; k < n; ++k)
    if ((static_cast<unsigned char>(s[i + k]) & 0xC0) != 0x80) return 0;
  return n;
}

// Approximate width of a 12px sans-serif label, for sizing the legend.
double text_width(std::string_view s) {
  double chars = 0;
  for (char c : s) chars += (static_cast<unsigned char>(c) & 0xC0) != 0x80;
  return chars * 7.0;
}

struct Frame {
  double left, top, right, bottom;  // plot area in pixels
  double x_lo, x_hi, y_lo, y_hi;    // data range (x already log2 when the plot asks for it)
  bool x_log2;
  double px(double x) const {
    const double t = x_log2 ? std::log2(x) : x;
    return left + (t - x_lo) / (x_hi - x_lo) * (right - left);
  }
  double py(double y) const { return bottom - (y - y_lo) / (y_hi - y_lo) * (bottom - top); }
};

bool usable_x(double x, bool log2) { return std::isfinite(x) && (!log2 || x > 0); }

void line_attrs(std::ostringstream& os, const Series& s) {
  os << " fill=\"none\" stroke=\"" << escape_xml(s.color) << "\" stroke-width=\"" << s.line_width
     << "\"";
  if (s.opacity < 1) os << " stroke-opacity=\"" << s.opacity << "\"";
  if (s.dashed) os << " stroke-dasharray=\"7 4\"";
}

}  // namespace

Axis nice_axis(double lo, double hi, int target_ticks) {
  if (!(hi > lo)) {
    const double pad = lo == 0 ? 1.0 : std::abs(lo) * 0.1;
    lo -= pad;
    hi += pad;
  }
  const double raw = (hi - lo) / std::max(1, target_ticks);
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  const double f = raw / mag;
  Axis a;
  a.step = (f <= 1 ? 1 : f <= 2 ? 2 : f <= 5 ? 5 : 10) * mag;
  // The epsilon keeps a bound that already sits on a tick from growing by a whole step.
  a.lo = std::floor(lo / a.step + 1e-9) * a.step;
  a.hi = std::ceil(hi / a.step - 1e-9) * a.step;
  const long n = std::lround((a.hi - a.lo) / a.step);
  for (long i = 0; i <= n; ++i) {
    const double t = a.lo + static_cast<double>(i) * a.step;
    a.ticks.push_back(std::abs(t) < a.step * 1e-9 ? 0.0 : t);
  }
  return a;
}

std::string format_tick(double value, double step) {
  const int decimals = std::max(0, static_cast<int>(std::ceil(-std::log10(step) - 1e-9)));
  if (std::abs(value) < step * 1e-6) value = 0;
  char buf[48];
  std::snprintf(buf, sizeof buf, "%.*f", decimals, value);
  return buf;
}

std::string escape_xml(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (std::size_t i = 0; i < text.size();) {
    const char c = text[i];
    const std::size_t n = utf8_length(text, i);
    if (n == 0 || (static_cast<unsigned char>(c) < 0x20 && c != '\t' && c != '\n' && c != '\r')) {
      out += "\xEF\xBF\xBD";  // U+FFFD: invalid UTF-8 and control bytes would break parsers
      i += std::max<std::size_t>(n, 1);
      continue;
    }
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      case '\'':
        out += "&#39;";
        break;
      default:
        out.append(text.substr(i, n));
    }
    i += n;
  }
  return out;
}

const std::string& palette(std::size_t i) {
  static const std::vector<std::string> colors = {"#1f77b4", "#d62728", "#2ca02c", "#ff7f0e",
                                                  "#9467bd", "#8c564b", "#e377c2", "#17becf"};
  return colors[i % colors.size()];
}

namespace {

// The data's extents (x in log2 where the axis is), the explicit x ticks included.
struct Extents {
  double x_min, x_max, y_min, y_max;
};
Extents data_extents(const Plot& plot) {
  double x_min = kNaN, x_max = kNaN, y_min = kNaN, y_max = kNaN;
  auto widen = [](double& lo, double& hi, double v) {
    lo = std::isnan(lo) ? v : std::min(lo, v);
    hi = std::isnan(hi) ? v : std::max(hi, v);
  };
  for (const Series& s : plot.series) {
    for (std::size_t i = 0; i < s.x.size() && i < s.y.size(); ++i) {
      if (!usable_x(s.x[i], plot.x_log2) || !std::isfinite(s.y[i])) continue;
      widen(x_min, x_max, plot.x_log2 ? std::log2(s.x[i]) : s.x[i]);
      const double e = i < s.y_err.size() && std::isfinite(s.y_err[i]) ? s.y_err[i] : 0.0;
      widen(y_min, y_max, s.y[i] - e);
      widen(y_min, y_max, s.y[i] + e);
    }
  }
  for (double t : plot.x_ticks)
    if (usable_x(t, plot.x_log2)) widen(x_min, x_max, plot.x_log2 ? std::log2(t) : t);
  if (std::isnan(x_min)) x_min = 0, x_max = 1;
  if (std::isnan(y_min)) y_min = 0, y_max = 1;
  if (plot.y_from_zero) widen(y_min, y_max, 0.0);
  return {x_min, x_max, y_min, y_max};
}

// Whether the x ticks are nice numbers (a linear axis without explicit ticks).
bool nice_x(const Plot& plot) { return plot.x_ticks.empty() && !plot.x_log2; }

Axis x_axis_of(const Plot& plot, double x_min, double x_max) {
  // x ticks are data values: nice numbers on a linear axis, else the explicit ticks, else
  // the powers of two that span the data on a log2 axis.
  Axis x_axis;
  if (nice_x(plot)) {
    x_axis = nice_axis(x_min, x_max, 6);
  } else {
    // Ticks sit at the data; pad the range so end markers stay off the axes.
    const double pad = x_max > x_min ? 0.06 * (x_max - x_min) : 0.5;
    x_axis.lo = x_min - pad;
    x_axis.hi = x_max + pad;
    for (double t : plot.x_ticks)
      if (usable_x(t, plot.x_log2)) x_axis.ticks.push_back(t);
    if (plot.x_ticks.empty())
      for (double k = std::floor(x_min); k <= std::ceil(x_max); ++k)
        x_axis.ticks.push_back(std::exp2(k));
  }
  return x_axis;
}

// The plot area, right of the y labels and left of the legend.
Frame frame_of(const Plot& plot, const Axis& x_axis, const Axis& y_axis) {
  double legend_w = 0;
  for (const Series& s : plot.series)
    if (!s.label.empty()) legend_w = std::max(legend_w, 44 + text_width(s.label));
  const double top = plot.note.empty() ? 44 : 60;
  return Frame{72,         top,       plot.width - 24 - legend_w, plot.height - 56.0,
               x_axis.lo,  x_axis.hi, y_axis.lo,                  y_axis.hi,
               plot.x_log2};
}

// The svg element, the background, the title and the note.
void write_header(std::ostringstream& os, const Plot& plot) {
  os << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << plot.width << "\" height=\""
     << plot.height << "\" viewBox=\"0 0 " << plot.width << ' ' << plot.height
     << "\" font-family=\"DejaVu Sans, Helvetica, Arial, sans-serif\" font-size=\"12\">\n";
  os << "<title>" << escape_xml(plot.title) << "</title>\n";
  os << "<rect width=\"" << plot.width << "\" height=\"" << plot.height << "\" fill=\"white\"/>\n";
  os << "<text x=\"" << num(plot.width / 2.0) << "\" y=\"24\" text-anchor=\"middle\" "
     << "font-size=\"16\" font-weight=\"bold\">" << escape_xml(plot.title) << "</text>\n";
  if (!plot.note.empty())
    os << "<text x=\"" << num(plot.width / 2.0) << "\" y=\"42\" text-anchor=\"middle\" "
       << "fill=\"#555\">" << escape_xml(plot.note) << "</text>\n";
}

void write_axes(std::ostringstream& os, const Plot& plot, const Frame& f, const Axis& x_axis,
                const Axis& y_axis) {
  const bool x_nice = nice_x(plot);
  // Grid, axes, ticks and tick labels.
  os << "<g class=\"axes\" stroke=\"#000\" stroke-width=\"1\">\n";
  for (double t : y_axis.ticks) {
    const double y = f.py(t);
    os << "<line x1=\"" << num(f.left) << "\" y1=\"" << num(y) << "\" x2=\"" << num(f.right)
       << "\" y2=\"" << num(y) << "\" stroke=\"#e6e6e6\"/>\n";
    os << "<line x1=\"" << num(f.left - 5) << "\" y1=\"" << num(y) << "\" x2=\"" << num(f.left)
       << "\" y2=\"" << num(y) << "\"/>\n";
    os << "<text x=\"" << num(f.left - 8) << "\" y=\"" << num(y) << "\" dy=\"0.35em\" "
       << "text-anchor=\"end\" stroke=\"none\">" << format_tick(t, y_axis.step) << "</text>\n";
  }
  for (double t : x_axis.ticks) {
    const double x = f.px(t);
    char label[32];
    std::snprintf(label, sizeof label, "%g", t);
    os << "<line x1=\"" << num(x) << "\" y1=\"" << num(f.top) << "\" x2=\"" << num(x) << "\" y2=\""
       << num(f.bottom) << "\" stroke=\"#e6e6e6\"/>\n";
    os << "<line x1=\"" << num(x) << "\" y1=\"" << num(f.bottom) << "\" x2=\"" << num(x)
       << "\" y2=\"" << num(f.bottom + 5) << "\"/>\n";
    os << "<text x=\"" << num(x) << "\" y=\"" << num(f.bottom + 19) << "\" "
       << "text-anchor=\"middle\" stroke=\"none\">"
       << (x_nice ? format_tick(t, x_axis.step) : std::string(label)) << "</text>\n";
  }
  os << "<line x1=\"" << num(f.left) << "\" y1=\"" << num(f.bottom) << "\" x2=\"" << num(f.right)
     << "\" y2=\"" << num(f.bottom) << "\"/>\n";
  os << "<line x1=\"" << num(f.left) << "\" y1=\"" << num(f.top) << "\" x2=\"" << num(f.left)
     << "\" y2=\"" << num(f.bottom) << "\"/>\n";
  os << "</g>\n";
  os << "<text x=\"" << num((f.left + f.right) / 2) << "\" y=\"" << plot.height - 14
     << "\" text-anchor=\"middle\" font-size=\"13\">" << escape_xml(plot.x_label) << "</text>\n";
  const double y_mid = (f.top + f.bottom) / 2;
  os << "<text x=\"18\" y=\"" << num(y_mid) << "\" transform=\"rotate(-90 18 " << num(y_mid)
     << ")\" text-anchor=\"middle\" font-size=\"13\">" << escape_xml(plot.y_label) << "</text>\n";
}

void write_series(std::ostringstream& os, const Plot& plot, const Frame& f) {
  // Data: lines, then error bars, then markers on top.
  os << "<g class=\"data\">\n";
  for (const Series& s : plot.series) {
    std::vector<std::pair<double, double>> pts;
    std::vector<std::size_t> idx;
    for (std::size_t i = 0; i < s.x.size() && i < s.y.size(); ++i) {
      if (!usable_x(s.x[i], plot.x_log2) || !std::isfinite(s.y[i])) continue;
      pts.emplace_back(f.px(s.x[i]), f.py(s.y[i]));
      idx.push_back(i);
    }
    if (s.line_width > 0) {
      os << "<polyline";
      if (!s.css_class.empty()) os << " class=\"" << escape_xml(s.css_class) << "\"";
      os << " points=\"";
      for (std::size_t k = 0; k < pts.size(); ++k)
        os << (k ? " " : "") << num(pts[k].first) << ',' << num(pts[k].second);
      os << "\"";
      line_attrs(os, s);
      os << " stroke-linejoin=\"round\"/>\n";
    }
    for (std::size_t k = 0; k < pts.size(); ++k) {
      const std::size_t i = idx[k];
      if (i >= s.y_err.size() || !(s.y_err[i] > 0) || !std::isfinite(s.y_err[i])) continue;
      const double x = pts[k].first, y1 = f.py(s.y[i] - s.y_err[i]), y2 = f.py(s.y[i] + s.y_err[i]);
      os << "<path class=\"err\" d=\"M" << num(x) << ' ' << num(y1) << " V" << num(y2) << " M"
         << num(x - 5) << ' ' << num(y1) << " H" << num(x + 5) << " M" << num(x - 5) << ' '
         << num(y2) << " H" << num(x + 5) << "\" fill=\"none\" stroke=\"" << escape_xml(s.color)
         << "\" stroke-width=\"1.5\"/>\n";
    }
    if (s.markers)
      for (const auto& [x, y] : pts)
        os << "<circle cx=\"" << num(x) << "\" cy=\"" << num(y) << "\" r=\"4.5\" fill=\""
           << escape_xml(s.color) << "\" stroke=\"white\" stroke-width=\"1\"/>\n";
  }
  os << "</g>\n";
}

void write_legend(std::ostringstream& os, const Plot& plot, const Frame& f) {
  // Legend, right of the plot area so it never hides data.
  os << "<g class=\"legend\">\n";
  double ly = f.top + 8;
  for (const Series& s : plot.series) {
    if (s.label.empty()) continue;
    const double lx = f.right + 16;
    if (s.line_width > 0) {
      os << "<line x1=\"" << num(lx) << "\" y1=\"" << num(ly) << "\" x2=\"" << num(lx + 26)
         << "\" y2=\"" << num(ly) << "\"";
      line_attrs(os, s);
      os << "/>\n";
    }
    if (s.markers)
      os << "<circle cx=\"" << num(lx + 13) << "\" cy=\"" << num(ly) << "\" r=\"4.5\" fill=\""
         << escape_xml(s.color) << "\"/>\n";
    os << "<text x=\"" << num(lx + 32) << "\" y=\"" << num(ly) << "\" dy=\"0.35em\">"
       << escape_xml(s.label) << "</text>\n";
    ly += 20;
  }
  os << "</g>\n";
}

}  // namespace

std::string render(const Plot& plot) {
  const Extents e = data_extents(plot);
  const Axis y_axis = nice_axis(e.y_min, e.y_max);
  const Axis x_axis = x_axis_of(plot, e.x_min, e.x_max);
  const Frame f = frame_of(plot, x_axis, y_axis);
  std::ostringstream os;
  write_header(os, plot);
  write_axes(os, plot, f, x_axis, y_axis);
  write_series(os, plot, f);
  write_legend(os, plot, f);
  os << "</svg>\n";
  return os.str();
}

}  // namespace kvlab::svg
