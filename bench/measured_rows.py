"""What the pack's memory model predicts for a measured record: a forward-peak row of
``bench/records/forward-peaks/`` or the configuration of an end-to-end run of ``bench/records/e2e/``.
The tests that hold the model to the records (bench/tests) and the docs rendered from them
(``python -m bench.render_docs``) both predict through here, so a row is predicted one way only."""
from __future__ import annotations

from dataclasses import replace

from . import _host

_host.load_pack()
from wan_sage.memory import activation_model  # noqa: E402
from wan_sage.memory.estimate import Estimate, GiB, Setup, activation_bytes, attention_plan, plan, sage_groups  # noqa: E402
from wan_sage.memory.weights import weights_for_key  # noqa: E402

# The short model names the measured rows use, and the presets they were measured at.
ROW_PRESETS = {"a14b": "wan2.2-a14b", "1.3b": "wan2.1-1.3b", "ti2v5b": "wan2.2-ti2v-5b"}
# sm90: the arch every row was measured on, and the Sage kernel that ran there.
MEASURED_CC = 90
MEASURED_SAGE_PATH = "sage2_sm90"
# The end-to-end records' ``config.weights`` and the weight keys they stand for.
E2E_WEIGHT_KEYS = {"gguf": "q4_k_m", "fp8": "fp8", "fp8_fast": "fp8_fast"}


def row_dims(r: dict) -> activation_model.WanDims:
    return activation_model.PRESETS[ROW_PRESETS[r["model"]]]


def self_attention_path(r: dict) -> str:
    """The self-attention path the row ran: Sage where the row asked for it and made Sage calls."""
    used_sage = r["attn"] == "sage" and (r.get("sage") or {}).get("sage_calls", 1) != 0
    return MEASURED_SAGE_PATH if used_sage else "sdpa"


def head_groups(r: dict, dims=None, path: str | None = None) -> int:
    """The head groups the row's Sage calls ran in: the memory mode's count where every Sage call was
    split (the dispatcher's record says so), else 1."""
    dims = dims or row_dims(r)
    path = path or self_attention_path(r)
    s = r.get("sage") or {}
    split = path != "sdpa" and s.get("head_split_calls", 0) == s.get("sage_calls", 0) > 0
    return sage_groups(dims, path, 1, r["tokens"], r["dtype"]) if split else 1


def predict_forward(r: dict) -> dict:
    """``activation_bytes`` of a forward row (its ``total`` is the predicted peak); raises if the row's
    recorded token count is not the one the model computes for its size."""
    d = row_dims(r)
    lat = activation_model.latent_shape(d, r["width"], r["height"], r["frames"])
    if activation_model.tokens(d, *lat[2:]) != r["tokens"]:
        raise ValueError(f"row {r['model']} {r['width']}x{r['height']}x{r['frames']}: {r['tokens']} tokens recorded, "
                         f"{activation_model.tokens(d, *lat[2:])} computed")
    path = self_attention_path(r)
    w = activation_model.Workload(L=r["tokens"], dtype=r["dtype"], self_attn=path,
                                  latent_elems_per_row=activation_model.latent_elems(lat),
                                  compiled=bool(r.get("compiled")), self_attn_groups=head_groups(r, d, path))
    return activation_bytes(d, w)


def e2e_estimate(config: dict, preset: str = "wan2.2-a14b", q_handed_over: bool = False) -> Estimate:
    """The estimate the Working-Memory Estimator makes for an end-to-end run's configuration
    (``record["config"]``): its weights with their LoRA, its size, attention and compile, on sm90 in bf16.
    A whole-model compile is planned as eager, as the node plans it, with streamed GGUF weights keeping the
    partial-load term.  ``q_handed_over``: Wan's self-attention hands q over to the Sage patch (the node's
    plan where the hand-over is installed; the route's and the CLI's plan leave it out)."""
    d = activation_model.PRESETS[preset]
    weights = weights_for_key(d, E2E_WEIGHT_KEYS[config.get("weights", "gguf")], (config.get("lora_rank") or 0) > 0,
                              compute="bf16")
    return plan(Setup(dims=d, latent=activation_model.latent_shape(d, config["width"], config["height"], config["frames"]),
                      attention=attention_plan("sage-auto" if config["attention"] == "sage" else "sdpa", MEASURED_CC),
                      weights=weights.setup, weights_bytes=weights.nbytes, dtype="bf16",
                      compiled=compiled_blocks(config), q_handed_over=q_handed_over,
                      other_compile=bool(config.get("compile")) and not compiled_blocks(config)))


def streamed_blocks_estimate(config: dict, ran: str, grouped: bool, dtype: str = "fp16",
                             preset: str = "wan2.2-a14b") -> Estimate:
    """The estimate the node makes for a whole-prompt run under Wan Compile Blocks once the model's streamed blocks
    have run compiled (``ran``: "lifted" or "staged", ``Setup.streamed_blocks_ran``): its configuration as
    :func:`e2e_estimate` plans it, in the run's compute ``dtype``, with q handed over to the Sage patch and its
    self-attention ``grouped`` as the run's dispatcher settled it."""
    est = e2e_estimate(config, preset, q_handed_over=True)
    return plan(replace(est.setup, dtype=dtype, compiled=True, streamed_blocks_staged=True, streamed_blocks_ran=ran,
                        sage_grouped=grouped))


def compiled_blocks(config: dict) -> bool:
    """Whether an end-to-end run compiled its transformer blocks one by one (the compiled figure), as
    opposed to running eagerly or compiling the whole model as one graph (planned as eager, as the node
    plans it)."""
    return activation_model.compiles_per_block((config.get("compile") or {}).get("keys"))


def gguf_stream_need_gib(preset: str = "wan2.2-a14b") -> list[float]:
    """What each eager expert that streamed GGUF weights, in the record files ``gguf_stream_copies`` was set
    from, held above its resident weights beyond the streamed reservation without that term (GiB).  The term
    is the fewest whole dequantised copies of the largest Linear (compute dtype) that covers the largest."""
    from . import _records
    need = []
    for p in _records.set_from("gguf_stream_copies"):
        for r in _records.rows(p):
            c = r.get("config")
            if not c or "prompts" in r or r.get("status") != "ok" or c.get("weights") != "gguf" or c.get("compile"):
                continue
            est = e2e_estimate(c, preset)
            base = est.reservation_partial - est.partial["fragmentation"]
            need += [((e["peak_reserved_gib"] - e["resident_gib"]) * GiB - base) / GiB for e in r["experts"].values()
                     if e["resident_frac"] < 0.9999]
    return need


def gguf_stream_copy_gib(preset: str = "wan2.2-a14b") -> float:
    """One dequantised copy of the largest Linear (d x f, bf16) of ``preset``, in GiB."""
    d = activation_model.PRESETS[preset]
    return 2 * d.dim * d.ffn_dim / GiB
