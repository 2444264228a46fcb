// ComfyUI lists every **/*.js under web/ as an extension and the frontend imports each one, so
// the helper modules must do nothing on import; only web/wan_sage.js may touch the frontend.
import assert from "node:assert/strict";
import { readdirSync, readFileSync, statSync } from "node:fs";
import { join, relative } from "node:path";
import { describe, it } from "node:test";
import { fileURLToPath, pathToFileURL } from "node:url";

const WEB = fileURLToPath(new URL("../../web/", import.meta.url));

function jsFiles(dir) {
  return readdirSync(dir).flatMap((f) => {
    const p = join(dir, f);
    return statSync(p).isDirectory() ? jsFiles(p) : p.endsWith(".js") ? [p] : [];
  });
}

const importsOf = (src) => [...src.matchAll(/^\s*(?:import|export)\s[^;]*?from\s+["']([^"']+)["']/gm)].map((m) => m[1]);

describe("web/ files", () => {
  const files = jsFiles(WEB).map((p) => relative(WEB, p).split("\\").join("/")).sort();

  it("are the entry point and side-effect-free helpers", () => {
    assert.ok(files.includes("wan_sage.js"));
    assert.ok(files.filter((f) => f !== "wan_sage.js").every((f) => f.startsWith("lib/")), files.join(", "));
  });

  it("helpers import only each other, and only the entry registers an extension", () => {
    for (const f of files) {
      const src = readFileSync(join(WEB, f), "utf8");
      if (f === "wan_sage.js") {
        assert.equal(src.match(/registerExtension\(/g).length, 1);
        continue;
      }
      assert.ok(!/registerExtension|addEventListener|document\.|window\.|setInterval/.test(src), `${f} touches the frontend`);
      for (const spec of importsOf(src)) assert.match(spec, /^\.\/[\w-]+\.js$/, `${f} imports ${spec}`);
    }
  });

  it("helpers add no globals when imported (as the frontend imports them)", async () => {
    const before = new Set(Reflect.ownKeys(globalThis));
    for (const f of files.filter((x) => x.startsWith("lib/"))) {
      const mod = await import(pathToFileURL(join(WEB, f)).href);
      for (const [name, v] of Object.entries(mod)) {
        assert.ok(typeof v === "function" || typeof v !== "object" || v === null || Object.isFrozen(v),
          `${f}: export ${name} is a mutable object`);
      }
    }
    const added = Reflect.ownKeys(globalThis).filter((k) => !before.has(k));
    assert.deepEqual(added, []);
  });

  it("name no absolute path of a machine", () => {
    for (const f of files) assert.doesNotMatch(readFileSync(join(WEB, f), "utf8"), /["'`](?:\/(?:work|home|root|tmp)\/|[A-Z]:\\)/);
  });
});
