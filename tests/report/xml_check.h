#pragma once
// A small well-formedness check for the SVG the report writes: one root element, tags
// balanced and properly nested, attribute values quoted, '&' only as an entity.
#include <cctype>
#include <string>
#include <vector>

namespace kvlab::test {

// Empty when the text is well-formed; otherwise the first problem found.
inline std::string xml_problem(const std::string& s) {
  for (std::size_t i = s.find('&'); i != std::string::npos; i = s.find('&', i + 1)) {
    const std::size_t semi = s.find(';', i);
    const std::string ent = semi == std::string::npos ? "" : s.substr(i + 1, semi - i - 1);
    const bool named = ent == "amp" || ent == "lt" || ent == "gt" || ent == "quot" || ent == "apos";
    bool numeric = ent.size() > 1 && ent[0] == '#';
    for (std::size_t k = 1; numeric && k < ent.size(); ++k)
      numeric = std::isxdigit(static_cast<unsigned char>(ent[k])) || (k == 1 && ent[k] == 'x');
    if (!named && !numeric) return "bad entity at " + std::to_string(i);
  }
  std::vector<std::string> stack;
  int roots = 0;
  for (std::size_t i = 0; i < s.size();) {
    if (s[i] != '<') {
      if (stack.empty() && !std::isspace(static_cast<unsigned char>(s[i])))
        return "text outside the root at " + std::to_string(i);
      ++i;
      continue;
    }
    if (s.compare(i, 4, "<!--") == 0) {
      const std::size_t end = s.find("-->", i);
      if (end == std::string::npos) return "unterminated comment";
      i = end + 3;
      continue;
    }
    std::size_t end = i + 1;
    char quote = 0;
    for (; end < s.size(); ++end) {
      if (quote) {
        if (s[end] == quote)
          quote = 0;
        else if (s[end] == '<')
          return "'<' in an attribute at " + std::to_string(end);
      } else if (s[end] == '"' || s[end] == '\'') {
        if (s[end - 1] != '=') return "unexpected quote at " + std::to_string(end);
        quote = s[end];
      } else if (s[end] == '=' && end + 1 < s.size() && s[end + 1] != '"' && s[end + 1] != '\'') {
        return "unquoted attribute at " + std::to_string(end);
      } else if (s[end] == '>') {
        break;
      } else if (s[end] == '<') {
        return "'<' inside a tag at " + std::to_string(end);
      }
    }
    if (end >= s.size()) return "unterminated tag at " + std::to_string(i);
    std::string tag = s.substr(i + 1, end - i - 1);
    i = end + 1;
    if (!tag.empty() && tag[0] == '/') {
      const std::string name = tag.substr(1);
      if (stack.empty() || stack.back() != name) return "unbalanced </" + name + ">";
      stack.pop_back();
      continue;
    }
    const bool self_closing = !tag.empty() && tag.back() == '/';
    const std::string name = tag.substr(0, tag.find_first_of(" \t\n/"));
    if (name.empty() || !std::isalpha(static_cast<unsigned char>(name[0])))
      return "bad tag name <" + tag + ">";
    if (stack.empty()) ++roots;
    if (!self_closing) stack.push_back(name);
  }
  if (!stack.empty()) return "unclosed <" + stack.back() + ">";
  if (roots != 1) return "expected one root element, found " + std::to_string(roots);
  return "";
}

}  // namespace kvlab::test
