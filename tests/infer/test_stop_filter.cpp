#include "infer/stop_filter.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "infer/sequence.h"

namespace kvlab {
namespace {

// Pushes each piece; returns everything released, with "|" after each call's output.
std::string run(const std::vector<std::string>& stops, const std::vector<std::string>& pieces,
                bool flush_at_end = false) {
  StopStringFilter f(stops);
  std::string out;
  for (const auto& p : pieces) out += std::string(f.push(p)) + "|";
  if (flush_at_end) out += std::string(f.flush()) + "|";
  return out;
}

TEST(StopStringFilter, WithoutStopsEveryPieceGoesStraightOut) {
  EXPECT_EQ(run({}, {"ab", "", "cd"}), "ab||cd|");
}

TEST(StopStringFilter, HoldsWhatMayBeginAStopAndDropsTheStop) {
  // "a" may begin "ab": held; "b" completes it: nothing more is released.
  EXPECT_EQ(run({"ab"}, {"xa", "b", "zz"}), "x|||");
  // "a" followed by "c" is no stop: released with it.
  EXPECT_EQ(run({"ab"}, {"xa", "c"}), "x|ac|");
  // A stop spread over three pieces.
  EXPECT_EQ(run({"abc"}, {"1a", "b", "c2"}), "1|||");
}

TEST(StopStringFilter, StoppedAfterAStopAndNotBefore) {
  const std::vector<std::string> stops = {"END"};
  StopStringFilter g(stops);
  EXPECT_EQ(g.push("the EN"), "the ");
  EXPECT_FALSE(g.stopped());
  EXPECT_EQ(g.push("D of it"), "");
  EXPECT_TRUE(g.stopped());
  EXPECT_EQ(g.flush(), "");
  EXPECT_EQ(g.push("more"), "");  // nothing after a stop
}

TEST(StopStringFilter, TheEarliestStopWins) {
  EXPECT_EQ(run({"cd", "bc"}, {"abcd"}), "a|");
  // "ab" may begin "abc" (held whole); then "d" makes "bd" appear first.
  EXPECT_EQ(run({"abc", "bd"}, {"ab", "d"}), "|a|");
}

TEST(StopStringFilter, FlushReleasesWhatIsHeld) {
  // The row ends for another reason (max tokens, context): the held text is its own.
  EXPECT_EQ(run({"ab"}, {"xa"}, true), "x|a|");
  EXPECT_EQ(run({"ab"}, {"xy"}, true), "xy||");
}

TEST(StopStringFilter, MultiByteCharacters) {
  // A stop string in UTF-8 whose first byte arrives alone (a byte tokenizer splits it).
  const std::string e = "\xc3\xa9";  // é
  EXPECT_EQ(run({e + "t"}, {"caf\xc3", "\xa9", "t!"}), "caf|||");
}

// A sequence streams whole characters only: a byte-level token that ends inside a UTF-8
// character is held until the character is complete, and what is left goes out at the end.
TEST(SequenceText, NeverReleasesHalfACharacter) {
  std::vector<std::string> tokens;
  for (int b = 0; b < 256; ++b) tokens.emplace_back(1, static_cast<char>(b));
  tokens.push_back("<|endoftext|>");
  const Tokenizer tok = Tokenizer::bpe(BpeTokenizer::from_parts(SplitPattern::Kvlab, tokens, {}, 1));
  const std::vector<std::string> stops;
  Sequence seq(std::vector<int32_t>{'a'}, SamplingOptions{}, 0, stops, 8);
  std::string released;
  for (const int id : std::vector<int>{0xC3, 0xA9, 'x', 0xE2, 0x82}) {
    seq.tokens.push_back(id);
    released += seq.release_last(tok) + "|";
  }
  EXPECT_EQ(released, "|\xC3\xA9|x|||");
  EXPECT_EQ(seq.flush(), "\xE2\x82");  // the end: held bytes go out as they are
}

}  // namespace
}  // namespace kvlab
