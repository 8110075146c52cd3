"""One rank of the Ulysses tests (tests/parallel/test_ulysses.py starts one process per rank).

Usage: python ulysses_worker.py RANK WORLD INIT_FILE OUT_DIR SCENARIO
Runs VC-Attention as yunchang's local attention over gloo and saves what the parent compares.
"""

import importlib.util
import os
import pathlib
import sys
import traceback

import torch
import torch.distributed as dist

ROOT = pathlib.Path(__file__).resolve().parents[2]


def register_package():
    """The checkout as ``vc_attention``, as tests/conftest.py does for the test process."""
    spec = importlib.util.spec_from_file_location("vc_attention", ROOT / "__init__.py",
                                                  submodule_search_locations=[str(ROOT)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["vc_attention"] = module
    spec.loader.exec_module(module)


def inputs(step, B=2, N=384, H=4, D=64):
    """The whole sequence, the same on every rank (and in the parent's one-process run)."""
    g = torch.Generator().manual_seed(1000 + step)
    q, k, v = (torch.randn(B, N, H, D, generator=g) for _ in range(3))
    v = v + 2.0 * torch.randn(B, 1, H, D, generator=g)  # a common offset per head, as in real V
    return q, k, v


def main():
    rank, world, init_file, out_dir, scenario = (int(sys.argv[1]), int(sys.argv[2]), sys.argv[3],
                                                 sys.argv[4], sys.argv[5])
    register_package()
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    from yunchang import set_seq_parallel_pg

    from vc_attention.kernels.sequence_parallel import StepClock, vc_long_context_attention

    result = {}
    try:
        if scenario == "heads":
            set_seq_parallel_pg(world, 1, rank, world)
            vc_long_context_attention(3, backend="reference")
        elif scenario == "mismatch":
            set_seq_parallel_pg(world, 1, rank, world)
            attn = vc_long_context_attention(4, backend="reference", bits=8 if rank == 0 else 16)
            q, k, v = (t[:, rank * 192:(rank + 1) * 192] for t in inputs(0))
            attn(q, k, v)
        elif scenario == "bits4_ring":  # no backend writes the LSE of a 4-bit call on a CPU
            set_seq_parallel_pg(1, world, rank, world)
            attn = vc_long_context_attention(4, bits=4)
            attn(*(t[:, rank * 192:(rank + 1) * 192] for t in inputs(0)))
        else:  # "usp:U:R:N:BACKEND:BITS": N tokens, three steps of a schedule (cold, warm, reuse)
            _, ulysses, ring, n, backend, bits = scenario.split(":")
            set_seq_parallel_pg(int(ulysses), int(ring), rank, world)
            clock = StepClock()
            attn = vc_long_context_attention(4, backend=backend, bits=int(bits), clock=clock, refresh_every=1,
                                             num_clusters=8)
            n = int(n)
            shard = n // world
            outs, perms = [], []
            for step in range(3):
                clock.begin(step, 8)
                q, k, v = (t[:, rank * shard:(rank + 1) * shard] for t in inputs(step, N=n))
                outs.append(attn(q, k, v))
                perms.append({key[-1]: e.plan.perm.clone() for key, e in attn.attn_processor._plans.items()})
            result["outs"], result["perms"] = outs, perms
            result["groupings"] = attn.attn_processor.groupings
    except Exception as e:  # the parent checks which error each rank raised
        result["error"] = f"{type(e).__name__}: {e}"
        result["trace"] = traceback.format_exc()
    torch.save(result, f"{out_dir}/rank{rank}.pt")
    dist.destroy_process_group()
    # Everything is saved: leave without the interpreter's teardown, where gloo's threads were once
    # destroyed unjoined ("terminate called without an active exception", exit -6) on a loaded CPU.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
