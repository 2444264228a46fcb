// Headless Chromium (playwright-core) against a running ComfyUI: load each workflow, wait for
// the wan-sage panels, read their fields, save a screenshot per workflow.  Prints one JSON
// object on stdout.  Usage: node panel_check.mjs URL OUT_DIR workflow.json...
import { chromium } from "playwright-core";
import { readFileSync } from "node:fs";
import { basename, join } from "node:path";

const [url, outDir, ...workflows] = process.argv.slice(2);
const browser = await chromium.launch({
  executablePath: process.env.CHROMIUM || "/usr/bin/chromium",
  args: ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"],
});
const result = { workflows: {}, errors: [] };
try {
  const page = await browser.newPage({ viewport: { width: 1800, height: 1100 } });
  page.on("pageerror", (e) => result.errors.push(String(e)));
  page.on("console", (m) => { if (m.type() === "error") result.errors.push(m.text()); });
  for (const wf of workflows) {
    // A fresh page per workflow: the 1.27 frontend can report core nodes as missing when graphs
    // are loaded back to back before its node definitions settle.
    await page.goto(url, { waitUntil: "load" });
    await page.waitForFunction(() => {
      const lg = window.LiteGraph ?? window.comfyAPI?.litegraph?.LiteGraph;
      const app = window.app ?? window.comfyAPI?.app?.app;
      return app?.graph && lg?.registered_node_types?.KSampler && lg.registered_node_types.WanWorkingMemoryEstimator;
    }, null, { timeout: 90000 });
    const data = JSON.parse(readFileSync(wf, "utf8"));
    await page.evaluate(async (graph) => {
      const app = window.app ?? window.comfyAPI.app.app;
      await app.loadGraphData(graph);
    }, data);
    const estimators = data.nodes.filter((n) => n.type === "WanWorkingMemoryEstimator").length;
    let panels = [];
    const t0 = Date.now();
    while (Date.now() - t0 < 20000) {
      panels = await page.$$eval('[data-testid="wan-sage-panel"]', (els) => els.map((el) => {
        const f = (k) => el.querySelector(`[data-field="${k}"]`);
        const out = {};
        for (const k of ["tokens", "activation_gb", "sage_extra_gb", "reservation_gb", "comfy_gb", "vram", "verdict"]) {
          out[k] = f(k)?.textContent?.trim() ?? null;
        }
        out.level = f("verdict")?.dataset?.level ?? null;
        out.visible = el.offsetParent !== null;
        return out;
      }));
      const ready = panels.filter((p) => p.tokens && /\d/.test(p.tokens) && p.level);
      if (ready.length >= estimators) break;
      await page.waitForTimeout(250);
    }
    await page.keyboard.press("Escape");
    const shot = join(outDir, basename(wf).replace(/\.json$/, ".png"));
    await page.screenshot({ path: shot });
    // A close-up of the first estimator at 100 % zoom, for the README.
    const box = await page.evaluate(() => {
      const app = window.app ?? window.comfyAPI.app.app;
      const node = app.graph._nodes.find((n) => n.type === "WanWorkingMemoryEstimator");
      if (!node) return null;
      const ds = app.canvas.ds;
      ds.scale = 1;
      ds.offset = [-node.pos[0] + 420, -node.pos[1] + 80];
      app.canvas.setDirty(true, true);
      return { w: node.size[0], h: node.size[1] };
    });
    let closeup = null;
    if (box) {
      await page.waitForTimeout(600);
      closeup = join(outDir, basename(wf).replace(/\.json$/, "-panel.png"));
      await page.screenshot({ path: closeup, clip: { x: 0, y: 0, width: Math.min(1800, 420 + box.w + 480),
                                                      height: Math.min(1100, 80 + box.h + 120) } });
    }
    result.workflows[basename(wf)] = { estimators, panels, screenshot: shot, closeup };
  }
} finally {
  await browser.close();
}
process.stdout.write(JSON.stringify(result) + "\n");
