#pragma once
// A text that reaches the corners of tokenizers: contractions in both cases, digits in runs,
// scripts without spaces, combining marks, ZWJ emoji and flags, odd whitespace, CRLF, special
// tokens' text and a trailing space run.
namespace kvlab::test {

inline constexpr char kTortureText[] =
    "I'm sure they'll say it's John's, we've We'RE I'D don't\n"
    "1 12 123 1234 12345 3.14159 1,000,000 ٣٤٥ ⅷ x2y22z222\n"
    "héllo wörld Ελληνικά русский 日本語のテキスト 한국어 עברית العربية\n"
    "👩‍👩‍👧‍👦 🇺🇸 e\u0301 a\u00A0b c\u3000d\n"
    "  two  spaces\tand\ttabs\r\n\r\n   \n\n\n  trailing   \n"
    "!!!??? ... --- ((x)) {\"k\": [1, 2]} <|endoftext|> $$$ 100% @user #tag \n  ";

}  // namespace kvlab::test
