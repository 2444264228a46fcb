"""ComfyUI adapter of wan-sage: node schemas (V3), model-patcher wiring, the extension entry point."""
from comfy_api.latest import ComfyExtension, io

from .estimator import WanWorkingMemoryEstimator
from .sage_patch import WanSageAttentionPatch

NODES = [WanSageAttentionPatch, WanWorkingMemoryEstimator]


class WanSageExtension(ComfyExtension):
    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        return list(NODES)


async def comfy_entrypoint() -> WanSageExtension:
    from ..attention import calibration
    from . import comfy_bridge
    calibration.set_host_dir(comfy_bridge.cache_dir())
    return WanSageExtension()
