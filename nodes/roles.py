"""Which attention calls are non-causal self-attention over one token set, per model family.

Shapes cannot tell self- from cross-attention (a clip of 512 tokens looks like Wan's padded text),
so the calls are tagged explicitly. For each supported model family we object-patch the ``forward``
of exactly the modules whose single attention call qualifies; the patched forward puts an
:class:`AttentionRole` into a *copy* of ``transformer_options`` and calls the original forward. The
attention override (``override.py``) permutes and quantises only calls that carry a role.

Supported (ComfyUI v0.29 source, read in ``comfy/ldm``):

- Wan 2.1 / 2.2 (``comfy.ldm.wan.model.WanModel``: 1.3B, 14B T2V/I2V, the 5B TI2V, and the
  VACE variant's main blocks): ``blocks[i].self_attn`` is ``WanSelfAttention``; its forward calls
  attention once, q/k/v all from the video tokens, no mask. Cross-attention (text, CLIP image) is a
  different module and stays untagged.
- HunyuanVideo 1.0 / 1.5 (``comfy.ldm.hunyuan_video.model.HunyuanVideo``): every
  ``double_blocks[i]`` and ``single_blocks[i]`` calls attention once over ``cat(text, video)``, non
  causal, with an optional additive per-key text-padding mask (handled as a permuted key bias). The
  token refiner (text-only, query-dependent mask) is not tagged.

Anything else (other families, Wan's causal ``ar_model``, LongCat-Video through WanVideoWrapper) is
not tagged: the node says so and every call keeps ComfyUI's attention.

Object patches are applied when the patched clone is loaded and reverted when it is unloaded, so the
user's model (which shares the weights) never runs them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# transformer_options key that carries the role of the attention call made inside a tagged forward.
ROLE_KEY = "vc_attention_role"


@dataclass(frozen=True)
class AttentionRole:
    """What the override needs to know about one tagged self-attention call site."""

    family: str  # "wan" | "hunyuan_video"
    layer: str  # module path, e.g. "blocks.3.self_attn" (part of the plan-cache key)
    index: int  # position among the model's tagged layers, 0-based (for "first/last blocks in BF16")
    total: int  # number of tagged layers in the model
    text_prefix: bool = False  # HunyuanVideo: the joint sequence starts with text tokens


class RoleTaggedForward:
    """Object patch for a module's ``forward``: tags the attention call it makes with a role.

    A callable object rather than a closure, so that a second VC-Attention node applied on top of an
    already patched model can find the original forward and replace the tag instead of nesting.
    """

    def __init__(self, original, role: AttentionRole):
        self.original = original
        self.role = role

    def __call__(self, *args, **kwargs):
        options = kwargs.get("transformer_options")
        if options is not None:
            # A copy: the caller passes the same dict to the block's cross-attention.
            options = dict(options)
            options[ROLE_KEY] = self.role
            kwargs["transformer_options"] = options
        return self.original(*args, **kwargs)


@dataclass
class ModelRoles:
    """The self-attention call sites found in one model (empty when the family is unknown)."""

    family: str | None
    model_class: str
    patches: dict[str, AttentionRole] = field(default_factory=dict)  # object-patch key -> role
    note: str = ""
    head_dim: int = 128

    @property
    def supported(self) -> bool:
        return bool(self.patches)


def _wan_classes():
    import comfy.ldm.wan.model as wan

    # Exact classes only: other Wan variants (S2V, HuMo, Animate, SCAIL, causal AR) add tokens or
    # masks whose attention pattern has not been checked here.
    return {wan.WanModel: "WanModel", wan.VaceWanModel: "VaceWanModel"}


def _hunyuan_classes():
    import comfy.ldm.hunyuan_video.model as hv

    return {hv.HunyuanVideo: "HunyuanVideo"}


def detect_roles(model_patcher) -> ModelRoles:
    """Find the tagged call sites of ``model_patcher``'s diffusion model (read-only)."""
    diffusion_model = model_patcher.get_model_object("diffusion_model")
    cls = type(diffusion_model)
    name = f"{cls.__module__}.{cls.__qualname__}"

    if cls in _wan_classes():
        import comfy.ldm.wan.model as wan

        blocks = diffusion_model.blocks
        sites = [f"blocks.{i}.self_attn" for i, b in enumerate(blocks)
                 if type(getattr(b, "self_attn", None)) is wan.WanSelfAttention]
        if len(sites) != len(blocks):
            return ModelRoles(None, name, note=f"{name}: blocks without a plain WanSelfAttention; "
                                               "VC-Attention patches nothing")
        patches = {f"diffusion_model.{s}.forward": AttentionRole("wan", s, i, len(sites))
                   for i, s in enumerate(sites)}
        return ModelRoles("wan", name, patches,
                          note=f"Wan ({len(sites)} self-attention layers; cross-attention untouched)",
                          head_dim=blocks[0].self_attn.head_dim)

    if cls in _hunyuan_classes():
        sites = [f"double_blocks.{i}" for i in range(len(diffusion_model.double_blocks))]
        sites += [f"single_blocks.{i}" for i in range(len(diffusion_model.single_blocks))]
        patches = {f"diffusion_model.{s}.forward": AttentionRole("hunyuan_video", s, i, len(sites), text_prefix=True)
                   for i, s in enumerate(sites)}
        return ModelRoles("hunyuan_video", name, patches,
                          note=f"HunyuanVideo ({len(sites)} joint text+video attention layers; "
                               "token refiner untouched)",
                          head_dim=diffusion_model.hidden_size // diffusion_model.num_heads)

    return ModelRoles(None, name, note=f"unknown model type {name}: VC-Attention patches nothing "
                                       "(supported: Wan 2.1/2.2, HunyuanVideo 1.0/1.5)")


def install_roles(model_patcher, roles: ModelRoles) -> None:
    """Add the role-tagging object patches to ``model_patcher`` (a clone owned by the caller)."""
    for key, role in roles.patches.items():
        current = model_patcher.get_model_object(key)
        # Re-patching an already patched model: wrap the original forward, not our own wrapper.
        original = current.original if isinstance(current, RoleTaggedForward) else current
        model_patcher.add_object_patch(key, RoleTaggedForward(original, role))
