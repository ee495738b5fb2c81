"""Learner checkpoints: model, optimizer, RNG and step counter, in torch distributed checkpoint
(DCP) format, one directory per step.

Keys are global: under expert parallelism each rank holds some experts under local indices,
so expert tensors are renamed to their global index before saving (`global_state_dict`) and
picked back by each rank on load. Replicated tensors are written once (DCP deduplicates them).

A checkpoint is complete only once its `COMPLETE` marker exists: it is written into
`step-N.partial/` and renamed to `step-N/` after every rank has finished, so a process killed in
the middle of a save leaves a `.partial` directory that `latest_complete` never returns. Rank 0
claims the step first (`ops.common.atomic.exclusive_dir`): a step that exists, or that another
writer is saving now, is refused on every rank with `ArtifactConflict`, never overwritten; the
files, the marker and the directory are fsynced before the rename publishes the step.
"""

from __future__ import annotations

import json
import re
from contextlib import ExitStack
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from ops.common.atomic import ArtifactConflict, exclusive_dir

_EXPERT = re.compile(r"(.*\.mlp\.experts\.local_experts\.)(\d+)(\..*)")
COMPLETE = "COMPLETE"


def _ep():
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return 0, 1
    return parallel_state.get_expert_model_parallel_rank(), parallel_state.get_expert_model_parallel_world_size()


def global_state_dict(model, num_experts: int) -> dict[str, torch.Tensor]:
    """This rank's parameters under global names (expert indices made global)."""
    rank, size = _ep()
    local = num_experts // size
    out = {}
    for k, v in model.state_dict().items():
        if k.endswith("_extra_state"):
            continue
        if m := _EXPERT.match(k):
            k = f"{m.group(1)}{rank * local + int(m.group(2))}{m.group(3)}"
        out[k] = v
    return out


def load_global_state_dict(model, sd: dict[str, torch.Tensor], num_experts: int) -> None:
    """Copy a full (global names) state dict into this rank's model, taking its own experts."""
    rank, size = _ep()
    local = num_experts // size
    own = model.state_dict()
    with torch.no_grad():
        for k, v in own.items():
            if k.endswith("_extra_state"):
                continue
            src = k
            if m := _EXPERT.match(k):
                src = f"{m.group(1)}{rank * local + int(m.group(2))}{m.group(3)}"
            if src not in sd:
                raise KeyError(f"checkpoint has no tensor {src!r}")
            v.copy_(sd[src].to(v.dtype))


def param_names(model, num_experts: int) -> dict[int, str]:
    """id(param) -> global name, to key optimizer state by name rather than by position."""
    rank, size = _ep()
    local = num_experts // size
    names = {}
    for k, p in model.named_parameters():
        k = k.removeprefix("module.")
        if m := _EXPERT.match(k):
            k = f"{m.group(1)}{rank * local + int(m.group(2))}{m.group(3)}"
        names[id(p)] = k
    return names


def optimizer_state(optimizer, names: dict[int, str]) -> dict:
    state = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p in optimizer.state:
                state[names[id(p)]] = {k: (v if torch.is_tensor(v) else torch.tensor(v)) for k, v in optimizer.state[p].items()}
    return state


def load_optimizer_state(optimizer, names: dict[int, str], state: dict) -> None:
    for group in optimizer.param_groups:
        for p in group["params"]:
            name = names[id(p)]
            if name in state:
                optimizer.state[p] = {k: v.clone() for k, v in state[name].items()}


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def save(directory: Path, step: int, model_sd: dict, optim_state: dict | None = None, meta: dict | None = None,
         before_commit: Callable[[], None] | None = None, replace: bool = False) -> Path:
    """Save a complete checkpoint as `directory/step-{step:06d}`; returns its path.

    Raises ArtifactConflict (on every rank) when that step exists already or another writer is
    saving it; `replace` swaps an existing step for this one (a rebuilt base policy).
    `before_commit` runs on every rank after the tensors are written and before the COMPLETE
    marker (a test hook: a process killed there must leave only a `.partial` directory)."""
    import torch.distributed.checkpoint as dcp

    directory = Path(directory)
    final = directory / f"step-{step:06d}"
    rank = _rank()
    with ExitStack() as claim:
        partial, refused = None, None
        if rank == 0:
            try:
                partial = claim.enter_context(exclusive_dir(final, replace=replace))
            except ArtifactConflict as e:
                refused = str(e)
        refused = from_rank0(refused)
        if refused is not None:
            raise ArtifactConflict(refused)
        partial = from_rank0(str(partial) if partial is not None else None)
        state = {"model": model_sd, "rng": {f"rank{rank}": torch.get_rng_state()}}
        if optim_state is not None:
            state["optim"] = optim_state
        dcp.save(state, checkpoint_id=partial)
        _barrier()
        if before_commit is not None:
            before_commit()
        if rank == 0:
            (Path(partial) / "meta.json").write_text(json.dumps({"step": step} | (meta or {}), indent=2))
            (Path(partial) / COMPLETE).write_text("")
        # leaving the claim on rank 0 fsyncs the step and renames it into place
    _barrier()
    return final


def from_rank0(value: str | None) -> str | None:
    """Rank 0's `value` on every rank (a collective in a multi-rank world)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def latest_complete(directory: Path) -> Path | None:
    """The newest checkpoint with a COMPLETE marker (partial ones are ignored)."""
    directory = Path(directory)
    if not directory.exists():
        return None
    done = sorted(p for p in directory.glob("step-[0-9]*") if is_complete(p) and not p.name.endswith(".partial"))
    return done[-1] if done else None


def is_complete(path: Path) -> bool:
    """A checkpoint directory whose COMPLETE marker was written (its tensors are all on disk)."""
    return Path(path).is_dir() and (Path(path) / COMPLETE).exists()


def meta(path: Path) -> dict:
    return json.loads((Path(path) / "meta.json").read_text())


def load(path: Path, model_template: dict, optim_template: dict | None = None, with_rng: bool = True) -> dict:
    """Load into templates shaped like what was saved (DCP loads in place).

    Keys are global names, so a checkpoint loads under another expert-parallel layout; the RNG
    state is per rank, so pass with_rng=False when the world size changed."""
    import torch.distributed.checkpoint as dcp

    rank = _rank()
    state = {"model": model_template}
    if with_rng:
        state["rng"] = {f"rank{rank}": torch.get_rng_state()}
    if optim_template is not None:
        state["optim"] = optim_template
    dcp.load(state, checkpoint_id=str(path))
    return state


def load_model_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every model tensor of a checkpoint (all experts), without a model or a process group, for
    export. Reads only the model entries (not the optimizer state), shaped from DCP's metadata."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = FileSystemReader(str(path)).read_metadata()
    model: dict[str, torch.Tensor] = {}
    for key, item in md.state_dict_metadata.items():
        where = md.planner_data.get(key, ()) if md.planner_data else ()
        if len(where) == 2 and where[0] == "model" and isinstance(item, TensorStorageMetadata):
            model[where[1]] = torch.empty(item.size, dtype=item.properties.dtype)
    dcp.load({"model": model}, checkpoint_id=str(path), no_dist=True)
    return model
