"""V3 node schemas of wan-sage.  Each ``execute`` calls the wiring in ``sage_patch`` / ``estimator``
and returns the MODEL plus a STRING report (also shown as a text preview, so nothing needs JS)."""
from __future__ import annotations

from comfy_api.latest import io, ui

from ..attention import registry
from ..memory import activation_model
from ..memory import report, request
from ..memory.request import CFG_LIMITS, MARGIN_GIB_MAX, SIZE_LIMITS
from ..memory.errors import RequestError
from . import comfy_bridge
from .compile_blocks import BACKENDS, MODES, apply_compile_blocks
from .estimator import POLICIES, SAGE_COUNT, Settings, apply_estimator
from .sage_patch import MEMORY_MODE_LABELS, apply_patch, memory_mode_id
from .text_encoder import apply_text_encoder_host_copy


class WanSageAttentionPatch(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="WanSageAttentionPatch",
            display_name="Wan 2.1/2.2 Sage Attention Patch",
            category="model_patches/wan-sage",
            description=("Runs this Wan model's long self-attention on SageAttention where it is measured faster "
                         "and fits in free VRAM, and every other call on PyTorch SDPA. Scoped to this model. "
                         "Without SageAttention installed it passes the model through unchanged."),
            inputs=[
                io.Model.Input("model", tooltip="the Wan 2.1/2.2 model to patch (from the loader, LoRA, "
                                                "ModelSampling or the Working-Memory Estimator)"),
                io.Combo.Input("kernel", options=["auto", *registry.KERNELS], default="auto",
                               tooltip="auto: the best kernel for this GPU, chosen per shape by measurement"),
                io.Int.Input("min_tokens", default=1024, min=0, max=1 << 20, step=64,
                             tooltip="calls with fewer query tokens stay on SDPA"),
                io.Boolean.Input("calibrate", default=True,
                                 tooltip="time Sage against SDPA once per shape (cached on disk); off: "
                                         "Sage for self-attention, SDPA for cross-attention"),
                io.Int.Input("memory_margin_mb", default=256, min=0, max=65536, step=64,
                             tooltip="VRAM kept free on top of the kernel's exact extra bytes"),
                io.Boolean.Input("check_finite", default=True,
                                 tooltip="catch a kernel that goes wrong: the first calls of each shape and one in "
                                         "64 after them are compared with SDPA on a slice of query rows (and checked "
                                         "for NaN/Inf); a call off by more than the accuracy bound is redone on "
                                         "SDPA and the shape stays there"),
                io.Combo.Input("memory_mode", options=list(MEMORY_MODE_LABELS), default=MEMORY_MODE_LABELS[0],
                               optional=True,
                               tooltip="within SDPA's memory: split Sage calls into head groups so they need "
                                       "about SDPA's memory, where the split is measured at most 2 % slower; "
                                       "fastest, more memory: never split unless free VRAM is short"),
            ],
            outputs=[io.Model.Output(tooltip="the same model with Sage attention, for the sampler; unchanged "
                                             "when SageAttention is not installed or the model is not Wan"),
                     io.String.Output(display_name="status",
                                      tooltip="what the patch did: the kernel, the installed SageAttention and "
                                              "the candidates for this GPU")],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def validate_inputs(cls, memory_mode=MEMORY_MODE_LABELS[0]):
        # Naming memory_mode (and no other input) here makes ComfyUI leave that one combo check to this
        # method, so the mode ids that earlier saved workflows hold ("sdpa", "fastest") still validate.
        if memory_mode_id(memory_mode) is None:
            return (f"memory_mode must be one of {', '.join(map(repr, MEMORY_MODE_LABELS))}; "
                    f"got {str(memory_mode)[:40]!r}")
        return True

    @classmethod
    def execute(cls, model, kernel, min_tokens, calibrate, memory_margin_mb, check_finite,
                memory_mode=MEMORY_MODE_LABELS[0]) -> io.NodeOutput:
        node_id = getattr(getattr(cls, "hidden", None), "unique_id", None)
        m, text = apply_patch(model, kernel, min_tokens, calibrate, memory_margin_mb, check_finite, node_id=node_id,
                              memory_mode=memory_mode_id(memory_mode or MEMORY_MODE_LABELS[0]))
        return io.NodeOutput(m, text, ui=ui.PreviewText(text))


class WanWorkingMemoryEstimator(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="WanWorkingMemoryEstimator",
            display_name="Wan Working-Memory Estimator",
            category="model_patches/wan-sage",
            description=("Predicts the activation memory of a Wan denoise from the model's config and the latent "
                         "size, and reserves it before sampling so ComfyUI offloads just enough weights; once the "
                         "first step shows the reservation can be smaller (compiled blocks, settled Sage head "
                         "groups), more weights are loaded for the later steps; where the "
                         "VAE decode that follows needs more room, the model is unloaded for it when sampling ends "
                         "(its weights keep their host copies, so nothing is copied back). "
                         "With the latent connected its size comes from the latent; otherwise from the size widgets."),
            inputs=[
                io.Model.Input("model", tooltip="the Wan 2.1/2.2 model to sample; its config (layers, width, "
                                                "weights) sets the estimate"),
                io.Int.Input("width", default=1280, min=SIZE_LIMITS["width"][0], max=SIZE_LIMITS["width"][1], step=16,
                             tooltip="video width in pixels, as in the latent node (ignored when latent is connected)"),
                io.Int.Input("height", default=720, min=SIZE_LIMITS["height"][0], max=SIZE_LIMITS["height"][1],
                             step=16,
                             tooltip="video height in pixels (ignored when latent is connected)"),
                io.Int.Input("frames", default=81, min=SIZE_LIMITS["frames"][0], max=SIZE_LIMITS["frames"][1], step=4,
                             tooltip="frames; Wan uses 4n+1 (others are rounded as ComfyUI rounds them, and "
                                     "the report says how); ignored when latent is connected"),
                io.Int.Input("batch_size", default=1, min=SIZE_LIMITS["batch"][0], max=SIZE_LIMITS["batch"][1],
                             tooltip="videos per batch (ignored when latent is connected)"),
                io.Float.Input("cfg", default=1.0, min=CFG_LIMITS[0], max=CFG_LIMITS[1], step=0.1,
                               tooltip="cfg != 1 runs cond and uncond (two rows when batched)"),
                io.Combo.Input("policy", options=list(POLICIES), default=POLICIES[0],
                               tooltip="what ComfyUI reserves per forward row: wan-sage's estimate; the larger of "
                                       "it and ComfyUI's own (about 2x, offloads more); or fixed_gib"),
                io.Float.Input("margin_gib", default=0.0, min=0.0, max=MARGIN_GIB_MAX, step=0.1,
                               tooltip="GiB added to wan-sage's estimate per row (e.g. for other nodes' VRAM use)"),
                io.Float.Input("fixed_gib", default=10.0, min=0.0, max=MARGIN_GIB_MAX, step=0.1,
                               tooltip="GiB reserved per row by the fixed policy"),
                io.Combo.Input("count_sage_extra", options=list(SAGE_COUNT), default=SAGE_COUNT[0],
                               tooltip="auto-detect: counted when the Sage patch is on this model"),
                io.Latent.Input("latent", optional=True,
                                tooltip="the video latent the sampler gets (e.g. EmptyHunyuanLatentVideo); when "
                                        "connected its size replaces width/height/frames/batch_size, which are "
                                        "then greyed out"),
            ],
            outputs=[io.Model.Output(tooltip="the same model with the reservation attached, for the Sage patch "
                                             "or the sampler"),
                     io.Int.Output(display_name="tokens", tooltip="video tokens per forward row (latent frames x "
                                                                  "height/16 x width/16 for Wan 2.1/A14B)"),
                     io.Float.Output(display_name="activation_gib",
                                     tooltip="predicted activation peak of one forward, in GiB"),
                     io.Float.Output(display_name="sage_extra_gib",
                                     tooltip="SageAttention's extra bytes on top of it, in GiB (0 on SDPA)"),
                     io.Float.Output(display_name="reservation_gib",
                                     tooltip="what ComfyUI is told to keep free per forward row, in GiB"),
                     io.String.Output(display_name="report",
                                      tooltip="the estimate as text: tokens, peak by phase, reservation, verdict")],
        )

    @classmethod
    def validate_inputs(cls, width=1280, height=720, frames=81, batch_size=1, cfg=1.0, policy=POLICIES[0],
                        margin_gib=0.0, fixed_gib=10.0, count_sage_extra=SAGE_COUNT[0]):
        # The inputs named here are checked by the estimate's one validator instead of ComfyUI's range and
        # combo checks, so the policy name earlier workflows saved ("fixed GB per row") still validates.
        # ComfyUI gives None for an input linked from another node: its value is checked in execute.
        given = {k: v for k, v in locals().items() if k != "cls" and v is not None}
        return _estimator_problem(given) or True

    @classmethod
    def execute(cls, model, width, height, frames, batch_size, cfg, policy, margin_gib, fixed_gib,
                count_sage_extra, latent=None) -> io.NodeOutput:
        problem = _estimator_problem({"width": width, "height": height, "frames": frames, "batch_size": batch_size,
                                      "cfg": cfg, "policy": policy, "margin_gib": margin_gib, "fixed_gib": fixed_gib,
                                      "count_sage_extra": count_sage_extra})
        if problem:  # a value linked from another node, which validation could not see
            raise ValueError(f"Wan Working-Memory Estimator: {problem}")
        settings = Settings(policy, float(margin_gib), float(fixed_gib), count_sage_extra)
        pixels = None
        if latent is not None and "samples" in latent and latent["samples"].ndim == 5:
            shape = list(latent["samples"].shape)
        elif comfy_bridge.is_wan(model):
            shape = list(activation_model.latent_shape(comfy_bridge.wan_dims(model), width, height, frames, batch_size))
            pixels = (width, height, frames)
        else:  # not a Wan model: apply_estimator passes it through without a shape
            shape = None
        m, est, text = apply_estimator(model, settings, shape, pixels=pixels, cfg=cfg)
        if est is None:
            return io.NodeOutput(m, 0, 0.0, 0.0, 0.0, text, ui=ui.PreviewText(text))
        s = report.summary(est)
        return io.NodeOutput(m, s["tokens"], round(s["activation_gib"], 3), round(s["sage_extra_gib"], 3),
                             round(s["reservation_gib"], 3), text, ui=ui.PreviewText(text))


# the estimator node's widgets by the estimate's field names (the one validator, memory.request.check_fields)
_ESTIMATOR_FIELDS = {"width": "width", "height": "height", "frames": "frames", "batch_size": "batch", "cfg": "cfg",
                     "policy": "policy", "margin_gib": "margin_gib", "fixed_gib": "fixed_gib"}


def _estimator_problem(values: dict) -> str | None:
    """What is wrong with the estimator node's values (its widgets, by input name), in one line naming the input;
    None where nothing is.  An input not in ``values`` (linked, not known yet) is not checked."""
    fields = {_ESTIMATOR_FIELDS[k]: v for k, v in values.items() if k in _ESTIMATOR_FIELDS}
    try:
        request.check_fields(fields, labels={"batch": "batch_size"})
    except RequestError as e:
        return str(e)
    count = values.get("count_sage_extra", SAGE_COUNT[0])
    if count not in SAGE_COUNT:
        return f"count_sage_extra must be one of {', '.join(SAGE_COUNT)}; got {str(count)[:40]!r}"
    return None


class WanCompileBlocks(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="WanCompileBlocks",
            display_name="Wan Compile Blocks",
            category="model_patches/wan-sage",
            description=("torch.compile of this Wan model's transformer blocks one by one, for the sampling. A "
                         "block whose weights ComfyUI streams from RAM has them put on the GPU for its call, so "
                         "every block runs one of at most two graphs (one for GGUF), shared by both experts of Wan "
                         "2.2 A14B: streaming causes no recompiles, and neither does ComfyUI's cond/uncond "
                         "batching, held to the batch the blocks were compiled for. Compiling costs seconds on the "
                         "first prompt of a ComfyUI start (less where the pack kept the run's compile file); the "
                         "Sage patch's panel says after a run whether it pays back over the prompt's steps. With "
                         "dynamic VRAM, the model is compiled as ComfyUI's own compile node compiles it: without "
                         "dynamic VRAM."),
            inputs=[
                io.Model.Input("model", tooltip="the Wan 2.1/2.2 model to compile (after the loader and LoRAs; "
                                                "the Sage patch and the estimator may come before or after)"),
                io.Combo.Input("backend", options=list(BACKENDS), default=BACKENDS[0],
                               tooltip="inductor: fuses the elementwise work around the matmuls and attention"),
                io.Combo.Input("mode", options=list(MODES), default=MODES[0],
                               tooltip="default compiles fastest; max-autotune-no-cudagraphs tunes kernels, "
                                       "a longer first compile"),
            ],
            outputs=[io.Model.Output(tooltip="the same model with its blocks compiled while it samples; unchanged "
                                             "when the model is not Wan"),
                     io.String.Output(display_name="status", tooltip="what was compiled")],
        )

    @classmethod
    def execute(cls, model, backend=BACKENDS[0], mode=MODES[0]) -> io.NodeOutput:
        m, text = apply_compile_blocks(model, backend, mode)
        return io.NodeOutput(m, text, ui=ui.PreviewText(text))


class WanTextEncoderHostCopy(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="WanTextEncoderHostCopy",
            display_name="Wan Text Encoder Host Copy",
            category="model_patches/wan-sage",
            description=("Keeps the host copy of the text encoder's weights while it is loaded, so the unload that "
                         "makes room for the Wan model copies nothing back. On an H200 that copy of umt5-xxl (bf16) "
                         "took 6-9 s of each prompt whose text changed. Host memory stays within what the text "
                         "encoder held before its first load. Put it between the CLIP loader and the text encode "
                         "nodes."),
            inputs=[io.Clip.Input("clip", tooltip="the text encoder, from the CLIP loader")],
            outputs=[io.Clip.Output(tooltip="the same text encoder; its unloads copy nothing back"),
                     io.String.Output(display_name="status", tooltip="whether the host copy applies")],
        )

    @classmethod
    def execute(cls, clip) -> io.NodeOutput:
        c, text = apply_text_encoder_host_copy(clip)
        return io.NodeOutput(c, text, ui=ui.PreviewText(text))
