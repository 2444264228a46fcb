"""Setups of the estimate for a size in pixels, as the route and the CLI make them (without their
validation), for tests that hold the estimate to its rules."""
from wan_sage.memory import activation_model
from wan_sage.memory.estimate import Setup, attention_plan, plan


def setup(dims, width, height, frames, batch=1, attention="sdpa", cc=None, **kw) -> Setup:
    """The Setup of ``dims`` at ``width`` x ``height`` x ``frames`` (ComfyUI's latent for them), with the
    attention of an ``attention`` choice (sdpa, sage-auto or a kernel) on ``cc``; other fields as given."""
    latent = activation_model.latent_shape(dims, width, height, frames, batch)
    return Setup(dims=dims, latent=latent, attention=attention_plan(attention, cc), pixels=(width, height, frames), **kw)


def estimate(dims, width, height, frames, batch=1, **kw):
    """:func:`plan` of :func:`setup`."""
    return plan(setup(dims, width, height, frames, batch, **kw))
