// Headless Chromium against a running ComfyUI with this pack: for each renderer mode (classic
// canvas, Nodes 2.0), load each workflow and read the wan-sage panels; on the detail workflow
// also read how they fit, whether nodes overlap, the size widgets' state, the SageAttention
// status, a simulated run (the events the server sends), and the latent disconnected; and a model
// wired to a latent of another channel count (what the panel sends, what the server answers, how
// the panel shows the problem).  Saves screenshots.  Prints one JSON object on stdout.
//
// Usage: node panel_check.mjs CONFIG.json, where CONFIG is {url, outDir, modes: ["classic",
// "vue"], workflows: [{name, path}], detail: name, run: {estimatorText, sageText, installedText,
// stats, installedStatus, missingStatus (null: the server's own)}, mismatch: {workflow: path, unetName, problem}}.
import { mkdirSync, readFileSync } from "node:fs";
import { join } from "node:path";

import { frame, launch, loadWorkflow, openApp, setSetting } from "./page.mjs";

const cfg = JSON.parse(readFileSync(process.argv[2], "utf8"));
const EST = "WanWorkingMemoryEstimator";
const SAGE = "WanSageAttentionPatch";
const SIZE_WIDGETS = ["width", "height", "frames", "batch_size"];

/** Everything the checks need from the page, in canvas units where it is a length. */
function inspect(page) {
  return page.evaluate(({ EST, SAGE, SIZE_WIDGETS }) => {
    const app = window.app ?? window.comfyAPI.app.app;
    const ds = app.canvas.ds;
    const canvasRect = app.canvas.canvas.getBoundingClientRect();
    const vue = (window.LiteGraph ?? window.comfyAPI?.litegraph?.LiteGraph)?.vueNodesMode === true;
    const nodeRect = (n) => {
      const el = document.querySelector(`.lg-node[data-node-id="${n.id}"]`);
      if (el) {
        const r = el.getBoundingClientRect();
        return [r.left, r.top, r.right, r.bottom];
      }
      const b = n.getBounding();
      const x = (b[0] + ds.offset[0]) * ds.scale + canvasRect.left;
      const y = (b[1] + ds.offset[1]) * ds.scale + canvasRect.top;
      return [x, y, x + b[2] * ds.scale, y + b[3] * ds.scale];
    };
    const text = (el, f) => el.querySelector(`[data-field="${f}"]`);
    const shown = (el) => !!el && !el.hidden && el.offsetParent !== null;
    // Fields whose text is cut at the panel's width (it should wrap instead).
    const cutOff = (el) => [...el.querySelectorAll("[data-field]")].filter((e) => shown(e)
      && (e.scrollWidth > e.clientWidth + 1 || e.getBoundingClientRect().right > el.getBoundingClientRect().right + 1))
      .map((e) => e.dataset.field);
    const fit = (el, n) => {
      const inner = el.firstElementChild;
      const r = el.getBoundingClientRect();
      const nr = nodeRect(n);
      return {
        visible: el.offsetParent !== null && r.height > 0,
        box: el.clientHeight, content: inner ? inner.offsetHeight : null, overflow: el.scrollHeight - el.clientHeight,
        below: (nr[3] - r.bottom) / ds.scale, outside: r.bottom > nr[3] + 1 || r.right > nr[2] + 1 || r.top < nr[1] - 1,
      };
    };
    const panel = (n, testid) => document.querySelector(`[data-testid="${testid}"][data-node-id="${n.id}"]`);
    const widgetState = (n, name) => {
      const w = n.widgets.find((x) => x.name === name);
      const row = document.querySelector(`.lg-node[data-node-id="${n.id}"] [data-widget-name="${name}"]`);
      return { disabled: w?.disabled === true, computedDisabled: w?.computedDisabled === true,
        inputDisabled: row ? row.querySelector("input")?.disabled === true : null,
        opacity: row ? Number(getComputedStyle(row).opacity) : null };
    };
    const nodes = app.graph._nodes;
    const estimators = nodes.filter((n) => n.type === EST).map((n) => {
      const el = panel(n, "wan-sage-panel");
      if (!el) return { id: n.id, missing: true };
      const fields = {};
      for (const f of ["problems", "assumption", "verdict", "size", "model", "tokens", "activation_gib", "sage_extra_gib",
        "reservation_gib", "comfy_gib", "vram", "error", "source", "report"]) {
        const e = text(el, f);
        fields[f] = shown(e) ? e.textContent.trim() : null;
      }
      const latentSlot = n.inputs.findIndex((i) => i.name === "latent");
      return { id: n.id, title: n.title, state: el.dataset.state, fields,
        level: text(el, "verdict")?.dataset.level ?? null, from: text(el, "size")?.dataset.from ?? null,
        latentConnected: latentSlot >= 0 && n.isInputConnected(latentSlot),
        widgets: Object.fromEntries(SIZE_WIDGETS.map((w) => [w, widgetState(n, w)])),
        cfgWidget: widgetState(n, "cfg"), fit: fit(el, n), cut: cutOff(el),
        firstLine: [...el.querySelectorAll("[data-field]")].find(shown)?.dataset.field ?? null,
        problemColour: shown(text(el, "problems")) ? getComputedStyle(text(el, "problems")).color : null };
    });
    const sages = nodes.filter((n) => n.type === SAGE).map((n) => {
      const el = panel(n, "wan-sage-stats");
      if (!el) return { id: n.id, missing: true };
      const f = (k) => (shown(text(el, k)) ? text(el, k).textContent.trim() : null);
      return { id: n.id, title: n.title, state: el.dataset.state, sage: text(el, "sage")?.dataset.state ?? null,
        headline: f("sage"), hint: f("hint"), link: text(el, "link")?.getAttribute("href") ?? null,
        status: f("status"), sageCalls: f("sage_calls"), fit: fit(el, n), cut: cutOff(el) };
    });
    const ours = (n) => n.type === EST || n.type === SAGE;
    const overlaps = [];
    for (const a of nodes) {
      for (const b of nodes) {
        if (a.id >= b.id || !(ours(a) || ours(b))) continue;
        const r = nodeRect(a), q = nodeRect(b);
        const ix = Math.min(r[2], q[2]) - Math.max(r[0], q[0]), iy = Math.min(r[3], q[3]) - Math.max(r[1], q[1]);
        if (ix > 0.5 && iy > 0.5) overlaps.push(`${a.title ?? a.type} #${a.id} and ${b.title ?? b.type} #${b.id}`);
      }
    }
    return { vue, scale: ds.scale, estimators, sages, overlaps };
  }, { EST, SAGE, SIZE_WIDGETS });
}

/** Wait until every estimator shows an estimate (or an error) and every Sage panel its status. */
async function waitPanels(page, data) {
  const want = { est: data.nodes.filter((n) => n.type === EST).length, sage: data.nodes.filter((n) => n.type === SAGE).length };
  await page.waitForFunction((want) => {
    const est = [...document.querySelectorAll('[data-testid="wan-sage-panel"]')]
      .filter((el) => ["ok", "error"].includes(el.dataset.state));
    const sage = [...document.querySelectorAll('[data-testid="wan-sage-stats"] [data-field="sage"]')]
      .filter((el) => el.dataset.state !== "unknown");
    return est.length >= want.est && sage.length >= want.sage;
  }, want, { timeout: 30000 }).catch(() => {});
  await page.waitForTimeout(1200); // the panels' next poll fits the nodes to the new content
}

/** The events a sampling run sends: executed (each node's ui text), and wan_sage.stats. */
async function simulateRun(page, { estimatorText, sageText, stats }) {
  await page.evaluate(({ EST, SAGE, estimatorText, sageText, stats }) => {
    const app = window.app ?? window.comfyAPI.app.app;
    const api = window.comfyAPI?.api?.api ?? app.api;
    const send = (type, detail) => api.dispatchCustomEvent(type, detail);
    for (const n of app.graph._nodes) {
      const id = String(n.id);
      if (n.type === EST) send("executed", { node: id, display_node: id, output: { text: [estimatorText] }, prompt_id: "simulated" });
      if (n.type !== SAGE) continue;
      send("executed", { node: id, display_node: id, output: { text: [sageText] }, prompt_id: "simulated" });
      if (stats) send("wan_sage.stats", { patch_id: `p${id}`, node_id: id, summary: stats, text: "simulated run" });
    }
  }, { EST, SAGE, estimatorText, sageText, stats });
  await page.waitForTimeout(1500);
}

/** Disconnect the first estimator's latent: its size widgets drive the size; then change the width. */
async function unlinkLatent(page) {
  const id = await page.evaluate((EST) => {
    const app = window.app ?? window.comfyAPI.app.app;
    const n = app.graph._nodes.find((x) => x.type === EST);
    n.disconnectInput(n.inputs.findIndex((i) => i.name === "latent"));
    return n.id;
  }, EST);
  const sel = `[data-testid="wan-sage-panel"][data-node-id="${id}"]`;
  await page.waitForSelector(`${sel} [data-field="size"][data-from="widgets"]`, { timeout: 10000 }).catch(() => {});
  await page.waitForTimeout(800);
  const unlinked = (await inspect(page)).estimators.find((e) => e.id === id);
  await page.evaluate(({ id }) => {
    const app = window.app ?? window.comfyAPI.app.app;
    const w = app.graph.getNodeById(id).widgets.find((x) => x.name === "width");
    w.value = 960;
    app.graph.setDirtyCanvas?.(true, true);
  }, { id });
  await page.waitForFunction((sel) => /56,700/.test(document.querySelector(`${sel} [data-field="tokens"]`)?.textContent ?? ""),
    sel, { timeout: 10000 }).catch(() => {});
  const edited = (await inspect(page)).estimators.find((e) => e.id === id);
  return { unlinked, edited };
}

/**
 * The TI2V-5B workflow (a 48-channel Wan22ImageToVideoLatent) with a Wan 2.1 1.3B model file (16
 * channels) in its loader: the request the panel sends, the server's own ``summary.problems``
 * (null when its answer has no such key), and the panel showing ``problem`` when the server names
 * none (the route's answer, with the problem added).
 */
async function channelMismatch(page, { unetName, problem }, data, dir) {
  const posts = [];
  const answered = [];
  await page.route("**/wan_sage/estimate", async (route) => {
    const res = await route.fetch();
    const body = await res.json().catch(() => null);
    const sent = JSON.parse(route.request().postData() ?? "null");
    if (sent?.model_file === unetName && body?.summary) {
      answered.push(Array.isArray(body.summary.problems) ? body.summary.problems : null);
      if (!body.summary.problems?.length) body.summary.problems = [problem];
    }
    await route.fulfill({ response: res, json: body });
  });
  page.on("request", (r) => { if (r.url().endsWith("/wan_sage/estimate")) posts.push(JSON.parse(r.postData() ?? "null")); });
  await loadWorkflow(page, data);
  await waitPanels(page, data);
  await page.evaluate((unetName) => {
    const app = window.app ?? window.comfyAPI.app.app;
    const loader = app.graph._nodes.find((n) => n.type === "UNETLoader");
    loader.widgets.find((w) => w.name === "unet_name").value = unetName;
    app.graph.setDirtyCanvas?.(true, true);
  }, unetName);
  await page.waitForSelector('[data-testid="wan-sage-panel"] [data-field="problems"]:not([hidden])', { timeout: 15000 })
    .catch(() => {});
  await page.waitForTimeout(1200);
  await frame(page, await packIds(page));
  const state = await inspect(page);
  const closeup = await shot(page, join(dir, "closeup-channel-problem.jpg"), await frame(page, await closeupIds(page)));
  return { post: posts.filter((p) => p?.model_file === unetName).at(-1) ?? null, serverProblems: answered.at(-1) ?? null,
    answers: answered.length, state, closeup };
}

/** The ids of the wan-sage nodes (framed for the checks: at a readable scale their panels show). */
function packIds(page) {
  return page.evaluate(({ EST, SAGE }) => {
    const app = window.app ?? window.comfyAPI.app.app;
    return app.graph._nodes.filter((n) => n.type === EST || n.type === SAGE).map((n) => n.id);
  }, { EST, SAGE });
}

/** The nodes a close-up shows: the first estimator and the Sage patch after it (the high-noise pair). */
async function closeupIds(page) {
  return page.evaluate(({ EST, SAGE }) => {
    const app = window.app ?? window.comfyAPI.app.app;
    const est = app.graph._nodes.find((n) => n.type === EST);
    const sage = app.graph._nodes.find((n) => n.type === SAGE && n.getInputNode?.(0)?.id === est.id)
      ?? app.graph._nodes.find((n) => n.type === SAGE);
    return [est.id, sage.id];
  }, { EST, SAGE });
}

async function shot(page, path, clip = null) {
  await page.mouse.move(5, VIEW_H - 5); // no hover highlight or tooltip in the picture
  await page.screenshot({ path, ...(clip ? { clip } : {}), ...(path.endsWith(".jpg") ? { type: "jpeg", quality: 82 } : {}) });
  return path;
}
const VIEW_H = 1100;

/** The Templates dialog on the pack's category: each template's title, and whether it is cut. */
async function templates(page, names, path) {
  await page.evaluate(async () => {
    const app = window.app ?? window.comfyAPI.app.app;
    await app.extensionManager.command.execute("Comfy.BrowseTemplates");
  });
  await page.waitForTimeout(2500);
  await page.evaluate(() => {
    const el = [...document.querySelectorAll("li, button, a, span, div")]
      .find((e) => e.children.length === 0 && e.textContent.trim() === "wan-sage" && e.offsetParent !== null);
    el?.click();
  });
  await page.waitForTimeout(2500);
  const titles = await page.evaluate((names) => {
    const out = {};
    for (const name of names) {
      const el = [...document.querySelectorAll("[role=dialog] *")]
        .find((e) => e.children.length === 0 && e.textContent.trim() === name && e.offsetParent !== null);
      out[name] = el ? { cut: el.scrollWidth > el.clientWidth + 1 || el.scrollHeight > el.clientHeight + 1 } : null;
    }
    return out;
  }, names);
  await shot(page, path);
  return titles;
}

const browser = await launch();
const result = { frontendVersion: null, modes: {}, errors: [], deprecations: [], templates: null };
try {
  for (const mode of cfg.modes) {
    await setSetting(cfg.url, "Comfy.VueNodes.Enabled", mode === "vue");
    await setSetting(cfg.url, "Comfy.TutorialCompleted", true);
    const dir = join(cfg.outDir, mode);
    mkdirSync(dir, { recursive: true });
    const out = { workflows: {}, detail: null, installed: null };
    result.modes[mode] = out;
    const opts = { errors: result.errors, deprecations: result.deprecations };
    for (const wf of cfg.workflows) {
      // A fresh page per workflow: the 1.27 frontend can report core nodes as missing when graphs
      // are loaded back to back before its node definitions settle.
      // The detail workflow shows a machine without SageAttention: where this server has it, the stats
      // route answers as the server of such a machine does.
      const missing = wf.name === cfg.detail && cfg.run.missingStatus
        ? { routes: { "**/wan_sage/stats": { runs: [], sage_status: cfg.run.missingStatus } } } : {};
      const page = await openApp(browser, cfg.url, { ...opts, ...missing });
      const posts = []; // the estimate requests the panels send
      page.on("request", (r) => { if (r.url().endsWith("/wan_sage/estimate")) posts.push(JSON.parse(r.postData() ?? "null")); });
      result.frontendVersion ??= await page.evaluate(() => window.__COMFYUI_FRONTEND_VERSION__ ?? null);
      const data = JSON.parse(readFileSync(wf.path, "utf8"));
      await loadWorkflow(page, data);
      await waitPanels(page, data);
      await frame(page, await packIds(page));
      const state = await inspect(page);
      state.posts = posts;
      state.screenshot = await shot(page, join(dir, `${wf.name}.png`));
      out.workflows[wf.name] = state;
      if (wf.name === cfg.detail) {
        const d = { before: state, posts };
        const ids = await closeupIds(page);
        d.closeupBefore = await shot(page, join(dir, "closeup-missing-before.jpg"), await frame(page, ids));
        d.before = await inspect(page);
        await simulateRun(page, { estimatorText: cfg.run.estimatorText, sageText: cfg.run.sageText, stats: null });
        d.after = await inspect(page);
        d.closeupAfter = await shot(page, join(dir, "closeup-missing-after.jpg"), await frame(page, ids));
        await frame(page, await packIds(page));
        d.afterAll = await inspect(page);
        d.screenshotAfter = await shot(page, join(dir, `${wf.name}-after.png`));
        Object.assign(d, await unlinkLatent(page));
        out.detail = d;
      } else {
        // A run with the Sage table: the tallest the panels get.
        await simulateRun(page, { estimatorText: cfg.run.estimatorText, sageText: cfg.run.installedText, stats: cfg.run.stats });
        await frame(page, await packIds(page));
        state.after = await inspect(page);
        state.screenshotAfter = await shot(page, join(dir, `${wf.name}-after.png`));
      }
      await page.close();
    }
    // The same workflow on a machine with SageAttention: the stats route answers for an installed
    // build, and the run sends wan_sage.stats as the patch does.
    const wf = cfg.workflows.find((w) => w.name === cfg.detail);
    const page = await openApp(browser, cfg.url, { ...opts, routes: { "**/wan_sage/stats": { runs: [], sage_status: cfg.run.installedStatus } } });
    const data = JSON.parse(readFileSync(wf.path, "utf8"));
    await loadWorkflow(page, data);
    await waitPanels(page, data);
    const ids = await closeupIds(page);
    const inst = {};
    inst.closeupBefore = await shot(page, join(dir, "closeup-before.jpg"), await frame(page, ids));
    inst.before = await inspect(page);
    await simulateRun(page, { estimatorText: cfg.run.estimatorText, sageText: cfg.run.installedText, stats: cfg.run.stats });
    inst.closeupAfter = await shot(page, join(dir, "closeup-after.jpg"), await frame(page, ids));
    inst.after = await inspect(page);
    await frame(page, await packIds(page));
    inst.afterAll = await inspect(page);
    inst.screenshotAfter = await shot(page, join(dir, "installed-after.png"));
    out.installed = inst;
    result.templates ??= await templates(page, cfg.workflows.map((w) => w.name), join(cfg.outDir, "templates.png"));
    await page.close();
    const mm = await openApp(browser, cfg.url, opts);
    out.mismatch = await channelMismatch(mm, cfg.mismatch, JSON.parse(readFileSync(cfg.mismatch.workflow, "utf8")), dir);
    await mm.close();
  }
} finally {
  await browser.close();
}
process.stdout.write(JSON.stringify(result) + "\n");
