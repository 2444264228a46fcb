// Headless Chromium against a running ComfyUI WITHOUT this pack: open each workflow and read what
// the frontend says is missing (frontend 1.58: the "Missing Node Packs" warning and its details,
// which name a pack from the nodes' properties.cnr_id).  Prints one JSON object on stdout:
// {workflows: {name: {text, screenshot}}}.
//
// Usage: node missing_pack.mjs URL OUT_DIR NAME=workflow.json...
import { mkdirSync, readFileSync } from "node:fs";
import { join } from "node:path";

import { launch, loadWorkflow, openApp, setSetting } from "./page.mjs";

const [url, outDir, ...items] = process.argv.slice(2);
mkdirSync(outDir, { recursive: true });
const browser = await launch();
const result = { workflows: {} };
try {
  await setSetting(url, "Comfy.VueNodes.Enabled", false);
  await setSetting(url, "Comfy.TutorialCompleted", true);
  for (const item of items) {
    const [name, path] = [item.slice(0, item.indexOf("=")), item.slice(item.indexOf("=") + 1)];
    const page = await openApp(browser, url);
    await loadWorkflow(page, JSON.parse(readFileSync(path, "utf8")), { closeDialogs: false });
    await page.waitForTimeout(2500);
    // 1.58 shows a short warning with "View details"; the details list the missing packs.
    await page.evaluate(() => {
      const b = [...document.querySelectorAll("button, a, span")]
        .find((e) => /view details/i.test(e.textContent ?? "") && e.children.length < 3);
      b?.click();
    });
    await page.waitForTimeout(2500);
    const text = await page.evaluate(() => {
      const t = document.body.innerText;
      const i = t.search(/missing node/i);
      return i < 0 ? "" : t.slice(i, i + 1200);
    });
    const screenshot = join(outDir, `${name}.png`);
    await page.screenshot({ path: screenshot });
    result.workflows[name] = { text, screenshot };
    await page.close();
  }
} finally {
  await browser.close();
}
process.stdout.write(JSON.stringify(result) + "\n");
