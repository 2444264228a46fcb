// Shared by the browser checks: headless Chromium (playwright-core) on a running ComfyUI, the
// frontend's app and api objects, loading a workflow, and the view of the canvas.
import { chromium } from "playwright-core";

export const CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
  "--disable-background-networking", "--disable-component-update", "--disable-sync"];
export const VIEWPORT = { width: 1800, height: 1100 };
/** Where ComfyUI serves this pack's web/ folder (comfy_server links the pack in as "wan-sage"). */
export const PACK_URL_PART = "/extensions/wan-sage/";

export function launch() {
  return chromium.launch({ executablePath: process.env.CHROMIUM || "/usr/bin/chromium", args: CHROMIUM_ARGS });
}

/** Store a user setting on the server, before the page that reads it opens. */
export async function setSetting(url, id, value) {
  const r = await fetch(`${url}/api/settings/${encodeURIComponent(id)}`, { method: "POST", body: JSON.stringify(value) });
  if (!r.ok) throw new Error(`setting ${id}: HTTP ${r.status}`);
}

/**
 * A fresh page with the app loaded.  ``errors`` collects page errors and console errors;
 * ``deprecations`` collects every deprecation warning whose stack passes through this pack's
 * files (LiteGraph's own, repeated for each call, and console.warn's).
 */
export async function openApp(browser, url, { errors = [], deprecations = [], routes = {} } = {}) {
  const page = await browser.newPage({ viewport: VIEWPORT });
  page.on("pageerror", (e) => errors.push(e.stack ?? String(e)));
  page.on("console", (m) => { if (m.type() === "error") errors.push(`${m.text()} (${m.location()?.url ?? ""})`); });
  await page.exposeFunction("__wanSageDeprecation", (text) => deprecations.push(text));
  await page.addInitScript((part) => {
    const warn = console.warn.bind(console);
    console.warn = (...args) => {
      const stack = new Error().stack ?? "";
      if (/deprecat/i.test(String(args[0])) && stack.includes(part)) window.__wanSageDeprecation(`${args[0]}\n${stack}`);
      return warn(...args);
    };
  }, PACK_URL_PART);
  for (const [pattern, body] of Object.entries(routes)) {
    await page.route(pattern, (route) => route.fulfill({ status: 200, contentType: "application/json", body: JSON.stringify(body) }));
  }
  await page.goto(url, { waitUntil: "load" });
  await page.waitForFunction(() => {
    const lg = window.LiteGraph ?? window.comfyAPI?.litegraph?.LiteGraph;
    const app = window.app ?? window.comfyAPI?.app?.app;
    return app?.graph && app.canvas?.canvas && lg?.registered_node_types?.KSampler;
  }, null, { timeout: 90000 });
  await page.waitForTimeout(1000); // 1.58 loads a graph into its canvas store a moment after the canvas exists
  await page.evaluate((part) => {
    const lg = window.LiteGraph ?? window.comfyAPI?.litegraph?.LiteGraph;
    if (!Array.isArray(lg?.onDeprecationWarning)) return;
    lg.alwaysRepeatWarnings = true; // LiteGraph warns once per message, and the frontend itself reads input.link first
    lg.onDeprecationWarning.push((message) => {
      const stack = new Error().stack ?? "";
      if (stack.includes(part)) window.__wanSageDeprecation(`${message}\n${stack}`);
    });
  }, PACK_URL_PART);
  return page;
}

/** Load a workflow; close a dialog it opened (e.g. 1.27's missing models), unless told not to. */
export async function loadWorkflow(page, data, { closeDialogs = true } = {}) {
  await page.evaluate(async (graph) => {
    const app = window.app ?? window.comfyAPI.app.app;
    await app.loadGraphData(graph);
  }, data);
  await page.waitForTimeout(500);
  if (!closeDialogs) return;
  const dialog = await page.evaluate(() => [...document.querySelectorAll("[role=dialog]")].some((d) => d.offsetParent !== null));
  if (dialog) await page.keyboard.press("Escape");
}

/**
 * Show the nodes ``ids`` (all of them when empty) at a scale of at most ``maxScale``, clear of the
 * frontend's side bar and top bar (which float over the canvas in 1.58); returns the screen
 * rectangle {x, y, width, height} around them, for a clipped screenshot.
 */
export async function frame(page, ids = [], { maxScale = 1, margin = 24 } = {}) {
  const left = 150, top = 120, right = 40, bottom = 40; // the canvas area no toolbar covers
  const box = await page.evaluate(({ ids, maxScale, margin, left, top, right, bottom }) => {
    const app = window.app ?? window.comfyAPI.app.app;
    const nodes = app.graph._nodes.filter((n) => !ids.length || ids.includes(n.id));
    const s0 = app.canvas.ds.scale;
    const b = nodes.map((n) => {
      const r = [...n.getBounding()];
      const el = document.querySelector(`.lg-node[data-node-id="${n.id}"]`); // Nodes 2.0 draws its own height
      if (el) r[3] = Math.max(r[3], el.getBoundingClientRect().height / s0);
      return r;
    });
    const x0 = Math.min(...b.map((r) => r[0])), y0 = Math.min(...b.map((r) => r[1]));
    const x1 = Math.max(...b.map((r) => r[0] + r[2])), y1 = Math.max(...b.map((r) => r[1] + r[3]));
    const el = app.canvas.canvas.getBoundingClientRect();
    const scale = Math.min(maxScale, (el.width - left - right) / (x1 - x0), (el.height - top - bottom) / (y1 - y0));
    const ds = app.canvas.ds;
    ds.scale = scale;
    ds.offset[0] = left / scale - x0;
    ds.offset[1] = top / scale - y0;
    app.canvas.setDirty(true, true);
    return { x: el.left + left - margin, y: el.top + top - margin,
      width: Math.min(el.width - left + margin, (x1 - x0) * scale + 2 * margin),
      height: Math.min(el.height - top + margin, (y1 - y0) * scale + 2 * margin) };
  }, { ids, maxScale, margin, left, top, right, bottom });
  await page.waitForTimeout(800);
  return box;
}
