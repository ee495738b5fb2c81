"""Each stage measures its own cost: a StageMeter around the work, recorded with the cycle's
tables (ops.cost.cycle_costs) and returned as asset metadata."""

import contextlib

from ops.cost import cycle_costs
from ops.cost.meter import StageMeter
from ops.common.paths import home


@contextlib.contextmanager
def metered(stage: str, cycle: int, watch_pids=(), iteration: int = 1):
    """`with metered("rollout", cycle, server_pids) as meter: ...`; meter.cost after the block.

    `stage` is the asset's Dagster group name, so costs add up by the same stages as the graph;
    the work of a cycle's later on-policy iterations is recorded apart under the same stage."""
    meter = StageMeter(stage)
    with meter:
        for pid in watch_pids:
            if pid:
                meter.watch_process(pid)
        yield meter
    cycle_costs.record(home().data, cycle, meter.cost, part=None if iteration == 1 else f"iteration-{iteration}")


def cost_metadata(meter) -> dict:
    c = meter.cost
    return {"cost_usd": float(c.dollars), "cpu_core_seconds": float(c.cpu_core_seconds),
            "gpu_seconds": dict(c.gpu_seconds), "stage_wall_seconds": float(c.wall_seconds)}
