// wan-sage panel: what the Sage patch panel says about the installed SageAttention, from the
// ``sage_status`` object of GET /wan_sage/stats.
// Side-effect free (the frontend imports every .js under web/ as an extension).

/** The README section on installing SageAttention. */
export const SAGE_README_URL =
  "https://github.com/wan-sage/wan-sage#getting-sageattention-optional-not-installed-automatically";

/** The one-line install hint shown with a missing or rejected build. */
export const INSTALL_HINT_LINE =
  "Build SageAttention 2.x from source (main at or after ff71e1e), or pip install sageattention==1.0.6.";

export const MISSING_TEXT = "SageAttention not installed: this node passes the model through";

const failuresOf = (failures) =>
  Object.entries(failures && typeof failures === "object" ? failures : {})
    .filter(([k, v]) => typeof k === "string" && k && typeof v === "string" && v)
    .sort(([a], [b]) => (a < b ? -1 : a > b ? 1 : 0));

/**
 * {state, headline, detail, hint, link} for the panel.  ``state``: "missing" (no kernel can be
 * imported: the patch passes the model through), "rejected" (kernels of the installed build that
 * the self-test turned off, or the broken sm90 binding of some 2.2.0 builds: their calls run on
 * SDPA), "ok", or "unknown" (no status yet).  ``detail``: why (the import error, the self-test's
 * reasons), for a second line or a tooltip.
 */
export function sageStatusView(status) {
  if (!status || typeof status !== "object") {
    return { state: "unknown", headline: "", detail: "", hint: "", link: null };
  }
  const version = typeof status.sage_version === "string" && status.sage_version ? status.sage_version : null;
  const ck = status.ck_available === true;
  const failures = failuresOf(status.self_test_failures);
  if (!version && !ck) {
    return {
      state: "missing", headline: MISSING_TEXT,
      detail: typeof status.sage_error === "string" ? status.sage_error : "",
      hint: INSTALL_HINT_LINE, link: SAGE_README_URL,
    };
  }
  if (version && (failures.length || status.sm90_binding_broken === true)) {
    const names = failures.length ? failures.map(([k]) => k) : ["sage2_sm90"];
    const why = failures.length ? failures.map(([k, v]) => `${k}: ${v}`).join("; ")
      : "sage2_sm90: this build's sm90 kernel returns uninitialised memory (a known 2.2.0 build)";
    return {
      state: "rejected",
      headline: `SageAttention ${version} rejected by the self-test: ${names.join(", ")} off, its calls run on SDPA`,
      detail: why, hint: INSTALL_HINT_LINE, link: SAGE_README_URL,
    };
  }
  const parts = [version ? `SageAttention ${version}` : "SageAttention not installed"];
  if (ck) parts.push("comfy-kitchen int8");
  return { state: "ok", headline: parts.join(" \u00b7 "), detail: "", hint: "", link: null };
}
