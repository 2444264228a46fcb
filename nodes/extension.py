"""ComfyUI entry point: the extension that lists wan-sage's nodes (V3 ``comfy_entrypoint``)."""
from comfy_api.latest import ComfyExtension, io

from ..attention import timing
from . import comfy_bridge, routes
from .schemas import WanCompileBlocks, WanSageAttentionPatch, WanTextEncoderHostCopy, WanWorkingMemoryEstimator

NODES = [WanSageAttentionPatch, WanWorkingMemoryEstimator, WanCompileBlocks, WanTextEncoderHostCopy]


class WanSageExtension(ComfyExtension):
    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        return list(NODES)


async def comfy_entrypoint() -> WanSageExtension:
    timing.set_host_dir(comfy_bridge.cache_dir())
    routes.register()
    return WanSageExtension()
