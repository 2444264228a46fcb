import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { describe, it } from "node:test";

import { INSTALL_HINT_LINE, MISSING_TEXT, SAGE_README_URL, sageStatusView } from "../../web/lib/sage_status.js";

const README = readFileSync(new URL("../../README.md", import.meta.url), "utf8");
const PYPROJECT = readFileSync(new URL("../../pyproject.toml", import.meta.url), "utf8");

/** GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces to hyphens. */
const slug = (heading) => heading.trim().toLowerCase().replace(/[^\w\- ]/g, "").replace(/ /g, "-");

const NONE = { sage_version: null, sage_error: "ModuleNotFoundError: No module named 'sageattention'",
  sm90_binding_broken: false, ck_available: false, self_test_failures: {} };

describe("sageStatusView", () => {
  it("says SageAttention is missing and the node passes the model through, with the hint and the README link", () => {
    const v = sageStatusView(NONE);
    assert.equal(v.state, "missing");
    assert.equal(v.headline, "SageAttention not installed: this node passes the model through");
    assert.equal(v.headline, MISSING_TEXT);
    assert.equal(v.hint, INSTALL_HINT_LINE);
    assert.ok(!v.hint.includes("\n"), "one line");
    assert.equal(v.link, SAGE_README_URL);
    assert.match(v.detail, /No module named/);
  });

  it("names the kernels the self-test turned off, and why", () => {
    const v = sageStatusView({ ...NONE, sage_version: "2.2.0", sage_error: null,
      self_test_failures: { sage2_sm90: "returned non-finite values (uninitialised output?)", sage2_fp8_cuda: "raised X" } });
    assert.equal(v.state, "rejected");
    assert.equal(v.headline, "SageAttention 2.2.0 rejected by the self-test: sage2_fp8_cuda, sage2_sm90 off, its calls run on SDPA");
    assert.equal(v.detail, "sage2_fp8_cuda: raised X; sage2_sm90: returned non-finite values (uninitialised output?)");
    assert.equal(v.link, SAGE_README_URL);
    assert.equal(v.hint, INSTALL_HINT_LINE);
  });

  it("treats the broken sm90 binding as rejected before any self-test ran", () => {
    const v = sageStatusView({ ...NONE, sage_version: "2.2.0", sage_error: null, sm90_binding_broken: true });
    assert.equal(v.state, "rejected");
    assert.match(v.headline, /sage2_sm90 off/);
    assert.match(v.detail, /uninitialised memory/);
  });

  it("shows a working install in one muted line, comfy-kitchen alone included", () => {
    assert.deepEqual(sageStatusView({ ...NONE, sage_version: "2.2.0", sage_error: null }),
      { state: "ok", headline: "SageAttention 2.2.0", detail: "", hint: "", link: null });
    assert.equal(sageStatusView({ ...NONE, ck_available: true }).headline,
      "SageAttention not installed \u00b7 comfy-kitchen int8");
    assert.equal(sageStatusView({ ...NONE, ck_available: true }).state, "ok");
  });

  it("says nothing before the status arrives, and ignores malformed failures", () => {
    assert.equal(sageStatusView(null).state, "unknown");
    assert.equal(sageStatusView("x").state, "unknown");
    assert.equal(sageStatusView({ ...NONE, sage_version: "1.0.6", self_test_failures: { a: 3, "": "x" } }).state, "ok");
  });
});

describe("the README link", () => {
  it("points at the repository's README section on getting SageAttention", () => {
    const repo = /^Repository\s*=\s*"([^"]+)"/m.exec(PYPROJECT)[1];
    const [base, anchor] = SAGE_README_URL.split("#");
    assert.equal(base, repo);
    const headings = [...README.matchAll(/^#{1,6} (.+)$/gm)].map((m) => slug(m[1]));
    assert.ok(headings.includes(anchor), `no README heading with the anchor #${anchor}`);
    assert.ok(anchor.startsWith("getting-sageattention"));
  });
});
