"""One rank of an FSDP2 learner's trainer, for tests and benchmarks (run under torchrun).

``fsdp_worker.py JOB_DIR BATCHES OUT [--save-at V] [--activation-checkpointing]
[--every-state]``: every rank builds the job's sharded trainer (restoring the newest checkpoint
under JOB_DIR if there is one); rank 0 drives it through :class:`echo.learner.fsdp.ranks.Leader`
exactly as the learner process does, the others follow. Each batch of BATCHES (msgpack: a list
of batches, each a list of encoded TrainingGroups) is trained on and published as the learner
does; after version V a checkpoint is made. Rank 0 writes ``OUT/state.safetensors`` (the last
published state; with ``--every-state`` each version's too, as ``OUT/state-vN.safetensors``) and
``OUT/results.json`` (per step: the trained ids, the verdicts and their re-scoring figures, the
metrics; rank 0's peak memory and how many times its policy's first decoder layer's MLP started
a forward: twice per forward with grad when layers recompute).
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from echo.learner.fsdp import distributed, ranks
from echo.protocol import codec
from echo.protocol import messages as m


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("job_dir", type=Path)
    ap.add_argument("batches", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--save-at", type=int, default=-1)
    ap.add_argument("--activation-checkpointing", action="store_true")
    ap.add_argument("--every-state", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    d = distributed.init(torch.device("cpu"), args.activation_checkpointing)
    trainer, resumed = ranks.build(args.job_dir, d)
    if not d.leader:
        ranks.follow(trainer, d)
        distributed.close()
        return
    lead = ranks.Leader(trainer, d)
    mlp_forwards = [0]
    mlp = trainer.learner.model.model.layers[0].mlp
    # A pre-hook: a recomputation stops once it has what the backward needs, before the MLP's
    # forward returns, so a forward hook would not see it.
    mlp.register_forward_pre_hook(lambda *_: mlp_forwards.__setitem__(0, mlp_forwards[0] + 1))
    batches = [
        [m.decode(m.TrainingGroup, g, max_bytes=1 << 26) for g in b]
        for b in codec.unpackb(args.batches.read_bytes(), max_bytes=1 << 28)
    ]
    steps, state = [], {}
    for batch in batches:
        t0 = time.perf_counter()
        result = lead.train(batch)
        step_s = time.perf_counter() - t0
        state = lead.published_state()
        if lead.version == args.save_at:
            lead.save_checkpoint(args.job_dir / "checkpoints", 0, f"v{lead.version}".encode())
        lead.remember(lead.version, state)
        if args.every_state:
            args.out.mkdir(parents=True, exist_ok=True)
            save_file(state, str(args.out / f"state-v{lead.version}.safetensors"))
        steps.append(
            {
                "trained": result.trained,
                "verdicts": [[v.rollout_id, v.ok, v.reason] for v in result.verdicts],
                "verdict_stats": [v.stats for v in result.verdicts],
                "metrics": result.metrics,
                "wall_s": step_s,
            }
        )
    lead.stop()
    distributed.close()
    args.out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(args.out / "state.safetensors"))
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    (args.out / "results.json").write_text(
        json.dumps(
            {
                "resumed": resumed.version if resumed else None,
                "steps": steps,
                "version": lead.version,
                "rank0_peak_rss_mb": peak_kb / 1024,
                "layer0_mlp_forwards": mlp_forwards[0],
            }
        )
    )


if __name__ == "__main__":
    main()
