"""VC-Attention: low-bit attention for video diffusion transformers.

The repository root is both the Python package ``vc_attention`` and the folder ComfyUI loads from
``custom_nodes/``. Importing it must stay cheap and must not touch ComfyUI: the library lives in
``kernels/`` (no ComfyUI), the nodes in ``nodes/`` (imported lazily by ``comfy_entrypoint``).
"""

__version__ = "0.1.0"

# ComfyUI serves every .js file in this folder to its front end.
WEB_DIRECTORY = "./web"


async def comfy_entrypoint():
    """ComfyUI's V3 entry point: returns the extension that lists our nodes."""
    from .nodes import VCAttentionExtension

    return VCAttentionExtension()


__all__ = ["WEB_DIRECTORY", "comfy_entrypoint", "__version__"]
