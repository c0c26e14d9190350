// Renders an ablation's report.html in headless Chromium (Debian's, driven by playwright-core
// with its executablePath: no browser is downloaded) at 1300 x 900, as a reader's browser shows
// it, and checks that it loads without console errors, page errors or requests off the page;
// that every figure's inline SVG has drawn (a box with a size, and data lines with a size);
// that every link of the findings lands on an element of the page; and that the findings
// section starts on the first screen. Prints one JSON line of what it saw; exits 1 on a failed
// check, 77 (skipped) without Chromium or playwright-core.
//   node render.js REPORT.html [SCREENSHOT_DIR]
// With SCREENSHOT_DIR, also writes the first screen and one PNG per section (its first
// 900 CSS pixels, at 0.5 device pixels per CSS pixel to keep the files small).
"use strict";
const fs = require("fs");
const path = require("path");

const WIDTH = 1300, HEIGHT = 900;
const chromium_path = process.env.KVLAB_CHROMIUM || "/usr/bin/chromium";
if (!fs.existsSync(chromium_path)) {
  console.log(`SKIP: chromium not found at ${chromium_path} (scripts/setup.sh --tests installs it)`);
  process.exit(77);
}
let chromium;
try {
  ({ chromium } = require("playwright-core"));
} catch (e) {
  console.log("SKIP: playwright-core is not installed (scripts/setup.sh --tests installs it)");
  process.exit(77);
}

async function main() {
  const [report, shots] = process.argv.slice(2);
  if (!report || !fs.existsSync(report)) {
    console.log(`usage: node render.js REPORT.html [SCREENSHOT_DIR]; no report at ${report}`);
    process.exit(2);
  }
  const browser = await chromium.launch({
    executablePath: chromium_path,
    headless: true,
    args: ["--no-sandbox", "--disable-gpu"],
  });
  const problems = [];
  let seen;
  try {
    const context = await browser.newContext({
      viewport: { width: WIDTH, height: HEIGHT },
      deviceScaleFactor: shots ? 0.5 : 1,
    });
    const page = await context.newPage();
    page.on("console", (m) => { if (m.type() === "error") problems.push(`console: ${m.text()}`); });
    page.on("pageerror", (e) => problems.push(`page error: ${e.message}`));
    const page_url = "file://" + path.resolve(report);
    page.on("request", (r) => { if (r.url() !== page_url) problems.push(`request: ${r.url()}`); });
    await page.goto(page_url, { waitUntil: "load" });
    seen = await page.evaluate(() => {
      const plots = [...document.querySelectorAll("figure")].map((fig) => {
        const svg = fig.querySelector("svg");
        const box = svg ? svg.getBoundingClientRect() : { width: 0, height: 0 };
        // The data: polylines and paths whose own box has a size (a flat line has a width).
        const lines = svg ? [...svg.querySelectorAll("polyline, path")].filter((l) => {
          const b = l.getBBox();
          return b.width > 0 || b.height > 0;
        }).length : 0;
        return { id: fig.id, width: box.width, height: box.height, lines };
      });
      const findings = document.getElementById("findings");
      const links = findings ? [...findings.querySelectorAll("a[href^='#']")] : [];
      return {
        plots,
        findings_top: findings ? findings.getBoundingClientRect().top + window.scrollY : null,
        findings: findings ? findings.querySelectorAll("li").length : 0,
        dangling: links.map((a) => a.getAttribute("href"))
          .filter((h) => !document.getElementById(h.slice(1))),
        sections: [...document.querySelectorAll("body > section[id]")].map((s) => s.id),
        height: document.documentElement.scrollHeight,
      };
    });
    if (seen.plots.length === 0) problems.push("no figure in the page");
    for (const p of seen.plots)
      if (p.width < 100 || p.height < 100 || p.lines === 0)
        problems.push(`figure ${p.id} did not draw (${p.width}x${p.height}, ${p.lines} data lines)`);
    if (seen.findings_top === null) problems.push("no findings section (#findings)");
    else if (seen.findings_top >= HEIGHT)
      problems.push(`the findings start at ${seen.findings_top} px, below the first screen (${HEIGHT} px)`);
    if (seen.findings === 0) problems.push("the findings section holds no finding");
    for (const h of seen.dangling) problems.push(`a finding links to ${h}, which is not on the page`);
    if (shots) {
      fs.mkdirSync(shots, { recursive: true });
      await page.screenshot({ path: path.join(shots, "first-screen.png") });
      for (const id of seen.sections) {
        const box = await page.locator(`#${id}`).boundingBox();
        if (!box) continue;
        await page.screenshot({
          path: path.join(shots, `${id}.png`),
          fullPage: true,
          clip: { x: 0, y: box.y, width: WIDTH, height: Math.min(box.height, 900) },
        });
      }
    }
  } finally {
    await browser.close();
  }
  console.log(JSON.stringify({ viewport: [WIDTH, HEIGHT], figures: seen.plots.length,
                               findings_top: seen.findings_top, findings: seen.findings,
                               height: seen.height, problems }));
  process.exit(problems.length === 0 ? 0 : 1);
}

main().catch((e) => {
  console.log(`render failed: ${e.stack || e}`);
  process.exit(1);
});
