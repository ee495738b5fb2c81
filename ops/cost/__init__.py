"""Stage costs and intelligence per dollar: `meter` measures a stage (device-seconds, tokens),
`prices` turns measurements into dollars, `accounting` adds up a cycle and computes intelligence
per dollar of a cycle and a campaign, `cycle_costs` keeps each cycle's stage costs on disk and
`plot` draws the campaign."""
