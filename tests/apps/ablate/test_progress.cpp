#include <gtest/gtest.h>

#include "apps/progress.h"
#include "apps/train_progress.h"

namespace kvlab {
namespace {

// A resumed run starts its bar at the checkpoint's step: rate and ETA count only the steps of
// this process (500 steps resumed, 10 more in 10 s: 1 step/s, 490 s left).
TEST(ProgressBar, RateAndEtaCountOnlyTheUnitsDoneSinceTheStart) {
  const ProgressBar::Rate resumed = ProgressBar::rate(510, 500, 1000, 10.0);
  EXPECT_DOUBLE_EQ(resumed.per_s, 1.0);
  EXPECT_DOUBLE_EQ(resumed.eta_s, 490.0);
  const ProgressBar::Rate fresh = ProgressBar::rate(10, 0, 1000, 5.0);
  EXPECT_DOUBLE_EQ(fresh.per_s, 2.0);
  EXPECT_DOUBLE_EQ(fresh.eta_s, 495.0);
  // Nothing done yet (or no time passed): no rate, no ETA.
  EXPECT_EQ(ProgressBar::rate(500, 500, 1000, 3.0).per_s, 0.0);
  EXPECT_EQ(ProgressBar::rate(500, 500, 1000, 3.0).eta_s, 0.0);
  EXPECT_EQ(ProgressBar::rate(5, 0, 1000, 0.0).per_s, 0.0);
}

// On a terminal the bar is cut to fit its width (a wrapped line leaves its first part behind at
// each redraw), never inside a UTF-8 character; an unknown width keeps the line whole.
TEST(ProgressBar, FitsTheLineToTheTerminal) {
  EXPECT_EQ(ProgressBar::fit("train [####] 5/10", 10), "train [##");
  EXPECT_EQ(ProgressBar::fit("short", 80), "short");
  EXPECT_EQ(ProgressBar::fit("exactly80", 9), "exactly8");
  EXPECT_EQ(ProgressBar::fit("whole line", 0), "whole line");
  EXPECT_EQ(ProgressBar::fit("ab\xc3\xa9"
                             "cd",
                             4),
            "ab");  // 'é' is two bytes: not split
  EXPECT_EQ(ProgressBar::fit("ab\xc3\xa9"
                             "cd",
                             5),
            "ab\xc3\xa9");
}

// Step 0 evaluates the initial weights and trains nothing: its loss shows as "-", not 0.
TEST(TrainProgress, StepZeroShowsNoTrainingLoss) {
  StepRecord r;
  r.val_loss = 3.5;
  EXPECT_EQ(step_status(r, 3.5, false), "loss - | val 3.5000 | 0.0k tok/s");
  r.step = 7;
  r.train_loss = 2.25;
  r.tokens_per_s = 25100;
  r.val_loss.reset();
  EXPECT_EQ(step_status(r, 3.5, false), "loss 2.2500 | val 3.5000 | 25.1k tok/s");
  r.step_s = 2.0;
  r.comm_s = 0.5;
  EXPECT_EQ(step_status(r, 3.5, true), "loss 2.2500 | val 3.5000 | 25.1k tok/s | comm 25%");
  // A task's run: the answers' accuracy beside the val loss.
  EXPECT_EQ(step_status(r, 3.5, false, 0.75), "loss 2.2500 | val 3.5000 acc 0.750 | 25.1k tok/s");
}

}  // namespace
}  // namespace kvlab
