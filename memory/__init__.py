"""Working-memory core of wan-sage: the Wan activation model, model-file headers, and the estimate.

:func:`plan` (in :mod:`.estimate`) is the one entry point: the node, the server route and the CLI build a
:class:`Setup` (the route and the CLI through :func:`.request.build`) and call it; :mod:`.report` words
the result.  Imports no ComfyUI; Sage's extra bytes come from :mod:`attention.kernel_bytes`."""
from .activation_model import PRESETS, WanDims, Workload, WeightSetup  # noqa: F401
from .estimate import Estimate, Setup, plan  # noqa: F401
