"""ComfyUI side of VC-Attention: the V3 extension and its nodes.

Imported lazily by the pack's ``comfy_entrypoint`` (ComfyUI is importable then). ``nodes`` translates
between ComfyUI and the kernel library (``..kernels``); the library never imports this package.

Files: ``patch.py`` (the patch node for ComfyUI's core models), ``wanvideo.py`` (the patch node for
WanVideoWrapper models), both adapters of ``engine.py`` (the backend/bits decision, plans and
grouping, the kernel call, error fallback, the run report); ``override.py`` (the core models'
per-call attention override, and its torch.compile op), ``roles.py`` (which calls are
self-attention, per model family), ``schedule.py`` (steps, grouping window, plan cache),
``config.py`` (the nodes' inputs resolved), ``history.py`` (where run reports go),
``compare.py`` (comparison node), ``environment.py`` (environment report).
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
