"""Working-memory core of wan-sage: the Wan activation model, model-file headers, the estimate.
Imports no ComfyUI; Sage's extra bytes come from :mod:`attention.kernel_bytes` (one source of truth)."""
from .activation_model import PRESETS, WanDims, Workload, WeightSetup  # noqa: F401
from .estimate import Estimate, EstimateRequest, estimate, activation_bytes  # noqa: F401
