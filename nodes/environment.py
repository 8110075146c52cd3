"""The environment node: GPU, versions, which VC-Attention backends run here and why not, self-test.

The same report as `python -m vc_attention.kernels.doctor` (kernels/doctor.py), the precompiled
cubins listed per architecture.
"""

from __future__ import annotations

from comfy_api.latest import io, ui

from ..kernels import doctor


class VCAttentionEnvironment(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="VCAttentionEnvironment",
            display_name="VC-Attention Environment",
            category="VC-Attention",
            description="Reports the GPU and its architecture, torch / CUDA / Triton versions, the "
                        "precompiled kernels found per GPU architecture (and whether they match the "
                        "installed source), which VC-Attention backends are available here and why not, "
                        "and runs a two-second self-test of the kernel against the reference.",
            inputs=[
                io.Boolean.Input("self_test", default=True,
                                 tooltip="Run the 8-bit kernel on a small input and compare with the reference "
                                         "(about two seconds)."),
            ],
            outputs=[io.String.Output("report", tooltip="The text shown on the node.")],
            is_output_node=True,
            not_idempotent=True,  # the environment can change between runs (drivers, cubins)
        )

    @classmethod
    def execute(cls, self_test=True) -> io.NodeOutput:
        text = doctor.format_report(doctor.run(with_self_test=self_test))
        return io.NodeOutput(text, ui=ui.PreviewText(text))
