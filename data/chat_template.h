#pragma once
// A model's chat template (GGUF's tokenizer.chat_template, or a file): the subset of Jinja that
// chat templates use, rendered as Hugging Face's apply_chat_template renders them (Jinja2 with
// trim_blocks and lstrip_blocks, the last newline of the template dropped, tojson without
// HTML escaping and in the keys' order, raise_exception, strftime_now, loop controls and the
// generation tag).
//
// The subset: text, {{ }}, {# #} and whitespace control (-); if/elif/else, for (over lists,
// dicts and strings, with `if`, `else`, tuple targets, loop.*, break and continue), set (to a
// name, a namespace attribute, or a block), macro and generation; literals, lists, dicts,
// attribute and item access, slices, calls, arithmetic, ~, comparisons, in, and/or/not,
// `a if b else c`; the tests and filters chat templates call, and the string, dict and list
// methods they call. Anything else is refused when the template is parsed, by name and line.
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

#include "data/tokenizer.h"
#include "platform/error.h"

namespace kvlab {

// What a template does at render time that a request caused: raise_exception's message (the
// template refuses the conversation) or a runtime error (an undefined value used, a type
// mismatch). The server answers 400 with it.
class TemplateError : public Error {
 public:
  explicit TemplateError(const std::string& message) : Error(message) {}
};

class ChatTemplate {
 public:
  // Parses the source; throws kvlab::Error naming `what`, the line and the construct (a
  // statement, filter, test or syntax outside the subset).
  explicit ChatTemplate(std::string_view source, std::string what = "chat template");
  // The text for these variables (messages, add_generation_prompt, bos_token, ...: a JSON
  // object, in the keys' order as a request gave them). Throws TemplateError.
  std::string render(const nlohmann::ordered_json& variables) const;

  struct Program;  // the parsed statements

 private:
  std::shared_ptr<const Program> program_;
  std::string what_;
};

// A conversation as a model's prompt: OpenAI's messages (each an object with a string role and a
// content that is a string, a list of text parts, joined by newlines as llama.cpp joins them, or
// null) rendered by the template with the tokenizer's BOS and EOS texts, then encoded with the
// special tokens read from the text (Tokenizer::encode_chat). Throws TemplateError naming a
// malformed message, or what the template raised.
struct ChatPrompt {
  std::string text;
  std::vector<int32_t> ids;
};
ChatPrompt chat_prompt(const ChatTemplate& tmpl, const Tokenizer& tok,
                       const nlohmann::ordered_json& messages, bool add_generation_prompt = true);

}  // namespace kvlab
