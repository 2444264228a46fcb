"""Attention core of wan-sage.  Imports no ComfyUI; importing the package itself imports nothing
(not even torch), so the CLI's memory estimate runs without torch.

registry       the kernels, declared once (torch-free)
kernel_bytes   exact extra bytes of each kernel's call (torch-free)
head_groups    the memory mode's head-group count and its bytes (torch-free)
kernels        what the installed packages offer; calling a kernel
policy         static eligibility (traceable), the CallShape of a call, the reason codes
planning       candidates, self-test, the choice from timings
execution      one call at run time: memory fit, head split, run, fallbacks, sampled output check
accuracy       the accuracy bound, and the check of a kernel's output rows against SDPA
timing         calibration on a real call and the timing cache (TimingCache)
file_lock      the cross-process lock of the timing cache (torch-free)
state          all mutable state behind one lock, its CallKey and Decision (torch-free)
op             the wan_sage::attention custom op torch.compile sees
override       the callable ComfyUI calls (SageAttentionOverride) and what it settled
inner_attention  the same patch as Raylight's inner-attention processor (multi-GPU Ulysses)
config         PatchConfig, the patch's options
stats          per-patch run statistics
selftest       the numerical self-test of a kernel
sdpa           PyTorch SDPA with ComfyUI's attention signature
"""
