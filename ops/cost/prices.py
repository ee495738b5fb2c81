"""Prices: what a device-second and a token cost, and the dollars of a measured stage.

Why prices are kept apart from measurements: dollars are recomputed from the raw measurements
whenever prices change, so a cycle's cost can be re-priced after the fact (`StageCost.priced`,
`ops.cost.accounting.cycle_cost`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

from pydantic import BaseModel, Field

if TYPE_CHECKING:
    from ops.cost.meter import StageCost


class CostError(ValueError):
    """A cost that cannot be computed as asked (no spend, unknown GPU type, bad input)."""


class PriceTable(BaseModel):
    """Prices that turn device-seconds and tokens into dollars.

    The defaults are plausible on-demand cloud list prices per device-hour (late 2025) and are
    meant to be overridden with what you actually pay. GPU instance prices usually include
    their host CPUs: on a GPU machine set `cpu_core_hour` to 0 if you do not want to count
    CPUs twice.
    """

    gpu_hour: Annotated[
        dict[str, float],
        Field(description="Dollars per GPU-hour by GPU class (H100, H200, B200, A100, ...)."),
    ] = {"H100": 2.99, "H200": 3.79, "B200": 5.99, "A100": 1.79}
    cpu_core_hour: Annotated[float, Field(ge=0.0, description="Dollars per CPU core-hour.")] = 0.048
    api_tokens_per_million: Annotated[
        float, Field(ge=0.0, description="Dollars per million tokens sent to or from an external API.")
    ] = 0.0

    def gpu_price(self, gpu_type: str) -> float:
        try:
            return self.gpu_hour[gpu_type]
        except KeyError:
            raise CostError(
                f"no price for GPU type {gpu_type!r}; add it to PriceTable.gpu_hour (known: {sorted(self.gpu_hour)})"
            ) from None


def device_dollars(cost: StageCost, prices: PriceTable) -> tuple[float, float, float]:
    """(CPU, GPU, API) dollars of one stage's measurements at `prices`."""
    cpu = cost.cpu_core_seconds / 3600.0 * prices.cpu_core_hour
    gpu = sum(sec / 3600.0 * prices.gpu_price(kind) for kind, sec in cost.gpu_seconds.items())
    api = cost.api_tokens / 1e6 * prices.api_tokens_per_million
    return cpu, gpu, api


def stage_dollars(cost: StageCost, prices: PriceTable) -> float:
    cpu, gpu, api = device_dollars(cost, prices)
    return cpu + gpu + api


def gpu_class(device_name: str) -> str:
    """Map a CUDA device name ('NVIDIA H100 80GB HBM3') to a price-table class ('H100')."""
    upper = device_name.upper()
    for cls in ("B200", "H200", "H100", "A100", "L40S", "A10G", "L4"):
        if cls in upper:
            return cls
    return device_name
