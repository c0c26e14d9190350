// Renders an ablation's report.html in headless Chromium (Debian's /usr/bin/chromium, driven
// by playwright-core) at 1300 x 900, as a reader's browser shows it, and checks that:
// it loads without console errors or page errors, every plot (inline SVG) has drawn lines or
// marks with a size, and the findings section starts on the first screen. Prints one JSON
// line of what it saw; exits 1 on a failed check, 77 (skipped) without Chromium.
//   node render.js REPORT.html [SCREENSHOT_DIR]
"use strict";
const fs = require("fs");
const path = require("path");

const chromium_path = process.env.KVLAB_CHROMIUM || "/usr/bin/chromium";
if (!fs.existsSync(chromium_path)) {
  console.log(`chromium not found at ${chromium_path}: skipped`);
  process.exit(77);
}
const { chromium } = require("playwright-core");

async function main() {
  const [report, shots] = process.argv.slice(2);
  const browser = await chromium.launch({
    executablePath: chromium_path,
    headless: true,
    args: ["--no-sandbox", "--disable-gpu"],
  });
  const problems = [];
  try {
    const page = await browser.newPage({ viewport: { width: 1300, height: 900 } });
    page.on("console", (m) => { if (m.type() === "error") problems.push(`console: ${m.text()}`); });
    page.on("pageerror", (e) => problems.push(`page error: ${e.message}`));
    page.on("requestfailed", (r) => problems.push(`request failed: ${r.url()}`));
    await page.goto("file://" + path.resolve(report), { waitUntil: "load" });
    const seen = await page.evaluate(() => {
      const plots = [...document.querySelectorAll("svg")].map((svg) => {
        const box = svg.getBoundingClientRect();
        return {
          title: (svg.querySelector("title, text") || {}).textContent || "",
          width: box.width,
          height: box.height,
          marks: svg.querySelectorAll("path, polyline, line, circle, rect").length,
        };
      });
      const findings = document.getElementById("findings");
      const external = [...document.querySelectorAll("[src], link[href]")]
        .map((e) => e.getAttribute("src") || e.getAttribute("href"))
        .filter((u) => /^(https?:)?\/\//.test(u));
      return {
        plots,
        findings_top: findings ? findings.getBoundingClientRect().top + window.scrollY : null,
        findings_sentences: findings ? findings.querySelectorAll("li").length : 0,
        external,
        height: document.documentElement.scrollHeight,
      };
    });
    if (seen.plots.length === 0) problems.push("no plot in the page");
    for (const p of seen.plots)
      if (p.width < 100 || p.height < 100 || p.marks < 5)
        problems.push(`plot "${p.title}" did not draw (${p.width}x${p.height}, ${p.marks} marks)`);
    if (seen.findings_top === null) problems.push("no findings section (#findings)");
    else if (seen.findings_top > 900) problems.push(`findings start at ${seen.findings_top} px, below the first screen`);
    if (seen.findings_sentences === 0) problems.push("the findings section holds no finding");
    for (const u of seen.external) problems.push(`external resource ${u}`);
    if (shots) {
      fs.mkdirSync(shots, { recursive: true });
      await page.screenshot({ path: path.join(shots, "first-screen.png") });
      await page.screenshot({ path: path.join(shots, "whole.png"), fullPage: true });
    }
    console.log(JSON.stringify({ plots: seen.plots.length, findings_top: seen.findings_top,
                                 findings: seen.findings_sentences, height: seen.height, problems }));
  } finally {
    await browser.close();
  }
  process.exit(problems.length === 0 ? 0 : 1);
}

main().catch((e) => {
  console.log(`render failed: ${e.stack || e}`);
  process.exit(1);
});
