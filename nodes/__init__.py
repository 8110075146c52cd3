"""ComfyUI side of VC-Attention: the V3 extension and its nodes.

Imported lazily by the pack's ``comfy_entrypoint`` (ComfyUI is importable then). ``nodes`` translates
between ComfyUI and the kernel library (``..kernels``); the library never imports this package.

Files: ``patch.py`` (patch node), ``override.py`` (per-call attention override), ``roles.py`` (which
calls are self-attention, per model family), ``schedule.py`` (sigma schedule, plan cache),
``compare.py`` (comparison node).
"""

from comfy_api.latest import ComfyExtension, io

from .compare import VCAttentionCompare
from .environment import VCAttentionEnvironment
from .patch import VCAttentionPatch
from .wanvideo import VCAttentionWanVideoPatch

NODES = [VCAttentionPatch, VCAttentionCompare, VCAttentionEnvironment, VCAttentionWanVideoPatch]


class VCAttentionExtension(ComfyExtension):
    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        return list(NODES)


__all__ = ["VCAttentionExtension", "VCAttentionPatch", "VCAttentionCompare", "NODES"]
