"""Render docs/attention-bench.md and docs/memory-calibration.md from the measured JSON lines
in docs/measurements/ and memory/calibration/ (run from the repository root)."""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import _host  # noqa: E402

_host.load_pack()
from wan_sage.memory import model as MM  # noqa: E402
from wan_sage.memory.estimate import activation_bytes  # noqa: E402

GiB = 2 ** 30
ROOT = Path(__file__).resolve().parents[1]
M = ROOT / "docs" / "measurements"


def rows(p):
    return [json.loads(line) for line in Path(p).read_text().splitlines() if line.strip()]


def attention_doc():
    a = rows(M / "2026-11-29-bench-h200-sa2.jsonl")
    ab = rows(M / "2026-11-29-bench-h200-sa2-ab.jsonl")
    s1 = rows(M / "2026-11-29-bench-h200-sa1.jsonl")
    o = ["# Attention kernels against SDPA on Wan shapes (H200)\n",
         "Measured on 2026-11-29 on one NVIDIA H200 (sm90) with torch 2.11.0+cu130 and triton 3.6.0.",
         "SageAttention 2.x was built from thu-ml/SageAttention main `d1a57a5` for sm90. The packaged 1.0.6 and",
         "comfy-kitchen 0.2.40 were measured too. All runs are bf16, with q/k/v laid out the way ComfyUI's Wan model",
         "passes them. Raw results are in `docs/measurements/`.\n",
         "```bash",
         "wan-sage bench --kernels all --iters 5 --json bench_sa2.jsonl          # 2.x + comfy-kitchen installed",
         "wan-sage bench --kernels sage1 --shapes a14b_720p81_self,a14b_480p81_self,a14b_720p81_cross --iters 3",
         "wan-sage bench --kernels sage2_sm90 --no-accuracy --shapes ...        # auto vs SDPA, interleaved A/B",
         "python3 -m pytest tests/gpu -q -rs    # gpu tier: 20 passed with 2.x, 8 passed with 1.0.6",
         "```\n",
         "## Every kernel on every Wan shape\n",
         "The ms column is the median of 5. The extra column is `max_memory_allocated` above the inputs, for the same",
         "call the dispatcher makes. The formula column comes from `attention/memory.py`. rel-L2 is against an fp32",
         "reference on the first 1024 queries.\n",
         "| shape | backend | ms | × SDPA | extra MB | formula MB | error | rel-L2 |",
         "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in a + [x for x in s1 if x["backend"] == "sage1"]:
        if r["backend"] == "auto" or "ms" not in r:
            continue
        err = f"{100 * r['formula_err']:+.2f} %" if "formula_err" in r else ""
        o.append(f"| {r['shape']} | {r['backend']} | {r['ms']:.2f} | {r['ratio']:.3f} | {r['extra_bytes'] / 1e6:.1f} | "
                 f"{r['formula_bytes'] / 1e6:.1f} | {err} | {r.get('rel_l2', 0):.4f} |")
    o += ["\n## The `auto` override end to end\n",
          "The override is called exactly as ComfyUI calls it, with the calibration cache already filled. Each call",
          "includes the decision, the memory check, the kernel and the NaN/Inf check. Its batches are interleaved",
          "with plain SDPA batches (A/B, 7 rounds), so clock drift affects both sides equally.\n",
          "| shape | chosen | × SDPA | × SDPA, no finite check | decision (CPU) |", "|---|---|---:|---:|---:|"]
    for r in ab:
        if r["backend"] == "auto":
            o.append(f"| {r['shape']} | {r['chosen']} | {r['ratio']:.3f} | {r['ratio_no_finite_check']:.3f} | "
                     f"{r['decision_us']:.1f} µs |")
    o.append("""
## Reading

- On Hopper only the sm90 kernel of SageAttention 2.x beats cuDNN SDPA: 1.41× on A14B 720p81 self-attention
  and 1.31–1.38× on the other self-attention shapes.
- These all lose to SDPA on Hopper:
  - the FP16-PV kernels: 2.x Triton, 2.x fp16_cuda, and 1.0.6 at 0.80×;
  - the sm89 FP8 kernel, at 0.67×;
  - comfy-kitchen's int8 attention, at 0.74–0.83×.

  `auto` therefore keeps SDPA wherever one of them would be the only option. With only 1.0.6 installed it
  chose SDPA for all three shapes measured.
- Every quantised kernel loses on cross-attention (0.38–0.63×), so `auto` keeps SDPA there (`cross_slower`).
  The worst `auto` shape is 1.3B 480p cross-attention, at 0.987× SDPA.
- The measured extra bytes match the formulas within +0.21 % for every kernel and shape.
- The per-call NaN/Inf check costs one host sync. At 720p that is invisible. On shorter self-attention shapes
  it costs up to 4 % (1.229× against 1.269× at 480p81).
""")
    (ROOT / "docs" / "attention-bench.md").write_text("\n".join(o) + "\n")


def memory_doc():
    P = {"a14b": "wan2.2-a14b", "1.3b": "wan2.1-1.3b", "ti2v5b": "wan2.2-ti2v-5b"}
    c = rows(ROOT / "memory" / "calibration" / "h200_forward.jsonl")
    o = ["# Working-memory model against the real Wan forward peak (H200)\n",
         "Measured on 2026-11-29 on one NVIDIA H200, with torch 2.11.0+cu130 and ComfyUI 0.3.64 (`a125cd84`).",
         "The allocator was cudaMallocAsync, which ComfyUI's `main.py` selects through `cuda_malloc`.\n",
         "Each row is one real sampling step (`comfy.sample.sample`, euler, cfg 1.0, cond only). The model is a real",
         "ComfyUI `WanModel` at real dims, built through ComfyUI's own model config, with random weights resident on",
         "the GPU. The peak is `torch.cuda.max_memory_allocated()` minus the allocation before the forward, taken in a",
         "`DIFFUSION_MODEL` wrapper. In the sage rows, self-attention runs on `sage2_sm90` and cross-attention on SDPA.\n",
         "```bash", "COMFYUI_PATH=... python3 bench/wan_forward_calibration.py --allocator async --out memory/calibration/h200_forward.jsonl", "```\n",
         "`tests/unit/test_memory_calibration.py` checks every row: the prediction must not be below the measured peak",
         "and must be at most 10 % above it.\n",
         "| model | dtype | attention | size | tokens | measured GiB | wan-sage GiB | error | ComfyUI GiB | ComfyUI ÷ measured | phase |",
         "|---|---|---|---|---:|---:|---:|---:|---:|---:|---|"]
    lo, hi = 1.0, -1.0
    for r in c:
        d = MM.PRESETS[P[r["model"]]]
        lat = MM.latent_shape(d, r["width"], r["height"], r["frames"])
        w = MM.Workload(L=r["tokens"], dtype=r["dtype"], self_attn="sdpa" if r["attn"] == "sdpa" else "sage2_sm90",
                        latent_elems_per_row=MM.latent_elems(lat))
        t = activation_bytes(d, w)
        p, m = t["total"], r["measured"]
        e = p / m - 1
        lo, hi = min(lo, e), max(hi, e)
        o.append(f"| {r['model']} | {r['dtype']} | {r['attn']} | {r['width']}×{r['height']}×{r['frames']} | "
                 f"{r['tokens']:,} | {m / GiB:.3f} | {p / GiB:.3f} | {100 * e:+.1f} % | {r['comfy'] / GiB:.2f} | "
                 f"{r['comfy'] / m:.2f}× | {t['dominant_phase']} |")
    o.append(f"\nOver all {len(c)} rows the error runs from {100 * lo:+.1f} % to {100 * hi:+.1f} %. ComfyUI's own figure"
             f" is 2.07× the measured peak for A14B at 720p81.\n")
    o += ["## Partial loading on a simulated 24 GB card\n",
          "A14B bf16 weights (26.6 GiB) are loaded through `comfy.sd.load_diffusion_model_state_dict`. A ballast",
          "allocation makes `get_free_memory()` read 24.0 GiB. Each run uses euler, cfg 1.0 and 4 steps, and all",
          "runs are from the same session.\n",
          "```bash",
          "COMFYUI_PATH=... python3 bench/partial_load.py --budget-gb 24 --res 1280x720x81 --steps 4 --configs comfy,ours,comfy+sage,ours+sage",
          "COMFYUI_PATH=... python3 bench/partial_load.py --budget-gb 24 --res 832x480x81 --steps 4 --lora-rank 64 --configs ours+sage,comfy+sage",
          "```\n",
          "| run | reservation / row | weights resident | s/step (median of 2–4) | peak allocated | peak reserved | result |",
          "|---|---:|---:|---:|---:|---:|---|"]
    for f, lab in (("2026-11-29-partial-720p-bf16-24gb.jsonl", "720p81"),
                   ("2026-11-29-partial-480p-bf16-lora64-24gb.jsonl", "480p81 + LoRA r64")):
        for r in rows(M / f):
            o.append(f"| {lab} {r['config']} | {r['reservation_gib_per_row']:.2f} GiB | {r['weights_resident_gib']:.2f} GiB | "
                     f"{r['median_2_4_s']:.3f} s | {r['peak_alloc_gib']:.2f} GiB | {r['peak_reserved_gib']:.2f} GiB | {r['status']} |")
    o.append("""
- **720p81, reservation.** wan-sage reserves 9.96 GiB per row with SDPA and 10.33 GiB with Sage; ComfyUI
  reserves 13.61 GiB. So wan-sage keeps 13.6 and 13.3 GiB of weights resident, where ComfyUI keeps 10.0.
  No run ran out of memory. The reference run found the edge between 8.5 GiB (out of memory) and 9.5 GiB
  (safe).
- **720p81, speed per step against ComfyUI's own reservation.**
  - SDPA: 1.022× (14.36 against 14.68 s). **This misses the 1.03× target.**
  - Sage: 1.035× (11.81 against 12.22 s). This meets it.
  - The reference run measured 1.02–1.05× across repeats, so the SDPA figure is within that run-to-run noise.
- **480p81 with a rank-64 LoRA and Sage.** The node reserves 5.24 GiB and keeps 18.4 GiB of weights
  resident. It did not run out of memory.
- **Sage against SDPA under the estimator at the 24 GB budget:** 14.36 / 11.81 = 1.22× per step.
- **Not measured yet:** fp8 weights. The session's GPU time ran out. The Sage call counts of these runs were
  not captured either: the harness read the stats after the patch's own wrapper had closed the window, and it
  has since been fixed.
""")
    (ROOT / "docs" / "memory-calibration.md").write_text("\n".join(o) + "\n")


if __name__ == "__main__":
    attention_doc()
    memory_doc()
