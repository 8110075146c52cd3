"""The fidelity study's harness: attention probes built from real video clips, and the method's
variants simulated on them in plain PyTorch.

Beside the library, not part of its API, and never loaded by ComfyUI: the scripts in
``benchmarks/fidelity/`` and the tests that pin FIDELITY.md's claims import it. ``probes`` needs
NumPy and, to decode the clips, Pillow (``pip install -e ".[test]"``).

- ``probes``: Q, K, V of a video DiT's self-attention built from the preview clips (how, step by step,
  in its docstring); ``find_video_dir`` says where the clips are looked for.
- ``simulate``: token orders, block energy, V's quantisation error, each variant's attention output
  and its error split, ExpCast's total-variation bound row by row.
- ``expcast_variants``: ExpCast's byte path with tail pieces, and with its reference point as a switch.
- ``schedule``: plan schedules replayed on captured inputs, with the node's own rule.
"""
